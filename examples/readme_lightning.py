import lightning.pytorch as pl
import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset, random_split

from ivyplug.optim import LAMB


class DigitsMLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_acc", (self.net(batch[0]).argmax(1) == batch[1]).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return LAMB(self.parameters(), lr=1e-2)


if __name__ == "__main__":
    pl.seed_everything(0)
    x, y = load_digits(return_X_y=True)  # 1797 8x8 images, bundled with scikit-learn
    data = TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y))
    train, val = random_split(data, [1440, 357], generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ivy_ps", max_epochs=15, logger=False, enable_checkpointing=False
    )  # 2 worker processes, async parameter server
    trainer.fit(DigitsMLP(), DataLoader(train, batch_size=32, shuffle=True), DataLoader(val, batch_size=357))
    if trainer.is_global_zero:
        print(f"validation accuracy: {trainer.callback_metrics['val_acc']:.3f}")
