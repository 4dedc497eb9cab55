"""Gradient compression for the Horovod API: `Compression.none` and `Compression.fp16`.

A compressor turns a tensor into what travels (`compress` returns the tensor
and a context) and back (`decompress`). fp16 halves the bytes of float32 and
float64 tensors; every other dtype travels unchanged.
"""

import tensorflow as tf


class Compressor:
    """Interface: `compress(tensor) -> (tensor, ctx)`, `decompress(tensor, ctx)`."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Casts float32/float64 tensors to float16 for the transfer and back after."""

    @staticmethod
    def compress(tensor):
        tensor = tf.convert_to_tensor(tensor)
        if tensor.dtype in (tf.float32, tf.float64):
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """The compressors a user picks from: `Compression.none`, `Compression.fp16`."""
    none = NoneCompressor
    fp16 = FP16Compressor
