import keras
from ivyplug.integrations.keras import LAMB, ElasticDataset, IvyLoadBalancer
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

keras.utils.set_random_seed(0)
x, y = load_digits(return_X_y=True)  # 1797 8x8 images, bundled with scikit-learn
x_train, x_test, y_train, y_test = train_test_split((x / 16.0).astype("float32"), y, test_size=0.2, random_state=0)
model = keras.Sequential(
    [keras.Input((64,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10, activation="softmax")]
)
model.compile(optimizer=LAMB(learning_rate=2e-2), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
data = ElasticDataset(x_train, y_train, batch_size=64)  # the balancer changes its batch size between epochs
model.fit(
    data.tf_dataset(),
    steps_per_epoch=data.steps_per_epoch,
    epochs=10,
    callbacks=[IvyLoadBalancer(data, max_batch_size=512)],
)
print(f"test accuracy: {model.evaluate(x_test, y_test, return_dict=True)['accuracy']:.3f}")
