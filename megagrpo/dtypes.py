"""Training dtypes by their config name (model.dtype, `megagrpo convert --dtype`)."""
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
