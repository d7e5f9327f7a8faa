"""The EXL3 format: `reference` (bit-exact decode, pure PyTorch), `layer` (one linear layer's tensors) and
`format` (read, validate and write layers in safetensors files)."""

from twinspark.exl3.format import Exl3FormatError, read_layer, validate_layer, write_layers
from twinspark.exl3.layer import Exl3Layer, random_layer

__all__ = ["Exl3FormatError", "Exl3Layer", "random_layer", "read_layer", "validate_layer", "write_layers"]
