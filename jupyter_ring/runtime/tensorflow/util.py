"""Which Keras ``tf.keras`` is, and small facts about TensorFlow every module of the adapter asks."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

# TensorFlow and Keras ship no annotations: their modules, layers, optimizers and variables are Any.

__all__ = ["LEGACY_KERAS", "keras_api", "optimizer_variables", "build_optimizer", "local_weights"]


def _which_keras() -> tuple[Any, bool]:
    """(``tf.keras``'s module, whether it is Keras 2): Keras 2 is the ``tf_keras`` package, which
    TensorFlow >= 2.16 gives as ``tf.keras`` when TF_USE_LEGACY_KERAS=1 was set before its import."""
    try:
        module = tf.keras   # its name is "tensorflow.keras" once a script imported from that path
        legacy = module.layers.Layer.__module__.startswith("tf_keras.")
    except ImportError as exc:  # TF_USE_LEGACY_KERAS is set but tf_keras is missing
        raise ImportError(f"TF_USE_LEGACY_KERAS={os.environ.get('TF_USE_LEGACY_KERAS')!r} asks TensorFlow for "
                          f"Keras 2, which is the tf_keras package: pip install 'tf_keras~={tf.__version__}' "
                          "(or unset TF_USE_LEGACY_KERAS to use Keras 3)") from exc
    return (module if legacy else keras), legacy


def optimizer_variables(optimizer: Any) -> list[Any]:
    """A Keras optimizer's variables: a property in Keras 3 and Keras 2, a method of Keras 2's
    legacy optimizers (``tf.keras.optimizers.legacy``)."""
    found = optimizer.variables
    return list(found() if callable(found) and not isinstance(found, list) else found)


def build_optimizer(optimizer: Any, variables: Sequence[Any]) -> None:
    """Create ``optimizer``'s slots (momentum, moments) for ``variables`` now, if it has none yet.

    Keras makes them at the optimizer's first step, so a rank that has not stepped holds fewer
    optimizer variables than one that has: a broadcast of them all (at the start of training, in
    an elastic state's sync to a newcomer) needs every rank built first. Built is what a first
    step would make: zero slots, nothing else changed.
    """
    if LEGACY_KERAS:
        from ._keras2 import build_optimizer as build_keras2

        build_keras2(optimizer, variables)
    elif not optimizer.built:
        optimizer.build(variables)


# keras_api: Keras as the user's tf.keras sees it: Keras 3 (the keras package), or Keras 2 (tf_keras)
keras_api, LEGACY_KERAS = _which_keras()


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs eagerly here (False inside tf.function and TF1 graphs)."""
    return bool(tf.executing_eagerly())


def local_weights(local_layers: Any) -> list[Any]:
    """The trainable weights of ``local_layers`` (a Keras layer, a list of them, or None)."""
    if local_layers is None:
        return []
    if isinstance(local_layers, keras_api.layers.Layer):
        local_layers = [local_layers]
    if not all(isinstance(layer, keras_api.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of keras.layers.Layer type.")
    return [var for layer in local_layers for var in layer.trainable_weights]
