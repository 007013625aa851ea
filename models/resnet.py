"""CIFAR-style ResNet-20 (He et al. 2016, section 4.2)."""

from __future__ import annotations

import keras

STAGE_FILTERS = (16, 32, 64)
BLOCKS_PER_STAGE = 3


def _conv_bn(x: keras.KerasTensor, filters: int, kernel: int, strides: int, name: str,
             relu: bool = True) -> keras.KerasTensor:
    """Conv (no bias) -> BatchNorm -> optional ReLU.

    Args:
      x: Input [batch, h, w, c_in].
      filters: Output channels.
      kernel: Square kernel size.
      strides: Convolution stride.
      name: Prefix of the layer names.
      relu: Whether to end with a ReLU.

    Returns:
      [batch, h / strides, w / strides, filters].
    """
    x = keras.layers.Conv2D(filters, kernel, strides=strides, padding="same", use_bias=False,
                            kernel_initializer="he_normal", name=f"{name}_conv")(x)
    x = keras.layers.BatchNormalization(name=f"{name}_bn")(x)
    return keras.layers.ReLU(name=f"{name}_relu")(x) if relu else x


def _basic_block(x: keras.KerasTensor, filters: int, strides: int, name: str
                 ) -> keras.KerasTensor:
    """Two 3x3 conv-BN layers with an identity (or 1x1 projection) shortcut.

    Args:
      x: Input [batch, h, w, c_in].
      filters: Output channels.
      strides: Stride of the first conv (2 at a stage change).
      name: Prefix of the layer names.

    Returns:
      [batch, h / strides, w / strides, filters].
    """
    shortcut = x
    if strides != 1 or x.shape[-1] != filters:
        shortcut = _conv_bn(x, filters, 1, strides, f"{name}_proj", relu=False)
    y = _conv_bn(x, filters, 3, strides, f"{name}_1")
    y = _conv_bn(y, filters, 3, 1, f"{name}_2", relu=False)
    y = keras.layers.Add(name=f"{name}_add")([shortcut, y])
    return keras.layers.ReLU(name=f"{name}_out")(y)


def resnet20(input_shape: tuple[int, int, int] = (32, 32, 3), num_classes: int = 10,
             seed: int | None = None) -> keras.Model:
    """ResNet-20 for small images (~0.27M parameters at 32x32x3).

    A 3x3 conv with 16 filters, then three stages of three basic blocks with 16, 32 and 64
    filters (stride 2 at the start of stages 2 and 3, where the shortcut is a 1x1 conv + BN
    projection; identity shortcuts elsewhere), global average pooling and a dense layer.

    Args:
      input_shape: ``(height, width, channels)``; works from 8x8 up (e.g. 28x28x1,
        32x32x3, 8x8x1).
      num_classes: Output logits.
      seed: Optional seed for the initialisers (sets Keras' global random seed).

    Returns:
      An uncompiled functional ``keras.Model`` mapping images [batch, h, w, c] to logits
      [batch, num_classes].
    """
    if seed is not None:
        keras.utils.set_random_seed(seed)
    inputs = keras.Input(input_shape, name="image")
    x = _conv_bn(inputs, STAGE_FILTERS[0], 3, 1, "stem")
    for stage, filters in enumerate(STAGE_FILTERS):
        for block in range(BLOCKS_PER_STAGE):
            strides = 2 if stage > 0 and block == 0 else 1
            x = _basic_block(x, filters, strides, f"stage{stage + 1}_block{block + 1}")
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    outputs = keras.layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="resnet20")
