"""Perseus-TF: data-parallel training for TensorFlow."""
