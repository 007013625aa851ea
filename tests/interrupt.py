"""A killed worker inside ``model.fit``, for the kill-and-resume tests of one process."""

import keras


class Die(keras.callbacks.Callback):
    """Ends ``fit`` with ``RuntimeError("killed")`` after ``after`` training steps, as a
    worker killed mid-epoch (a backup callback before it has written what it would)."""

    def __init__(self, after: int):
        super().__init__()
        self.after, self.seen = after, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.after:
            raise RuntimeError("killed")
