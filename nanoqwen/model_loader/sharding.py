"""A tensor-parallel rank's share of one checkpoint matrix held as the file holds it (a float tensor, or a quantised
one as GroupedWeights: a GGUF file's, an AWQ or GPTQ checkpoint's): its 1/tp of the output rows where the model's
linear is column-parallel, of the input columns where it is row-parallel (nanoqwen/layers/linear.py says which is
which). A float checkpoint's tensors are cut as they are read (loader.load_weights); these are cut whole."""

from __future__ import annotations

import torch

from nanoqwen.errors import ConfigError
from nanoqwen.ops.gguf_quants import GroupedWeights

ROWS, COLUMNS = 0, 1  # the dimension a share cuts


def tp_split_dim(model: torch.nn.Module, param: str, tensor_dims: int) -> int | None:
    """The dimension of a checkpoint tensor (of `tensor_dims` dimensions) that tensor parallelism
    cuts, as the parameter's module says (`tp_dims`), or None if every rank reads it whole."""
    module_name, _, leaf = param.rpartition(".")
    module = model.get_submodule(module_name)
    dim = getattr(module, "tp_dims", {}).get(leaf)
    if dim is None:
        return None
    return dim - (getattr(module, leaf).dim() - tensor_dims)


def model_share(model: torch.nn.Module, param: str, matrix: torch.Tensor | GroupedWeights,
                where: str) -> torch.Tensor | GroupedWeights:
    """This rank's share of `matrix` [rows, cols], the checkpoint's matrix for `param` (a parameter of the model,
    or one expert's matrix of a stacked experts parameter): cut as that parameter's module says (tp_split_dim),
    whole where it is not cut."""
    dim = tp_split_dim(model, param, 2) if model.tp_size > 1 else None
    return matrix if dim is None else rank_share(matrix, dim, model.tp_rank, model.tp_size, where)
def rank_share(matrix: torch.Tensor | GroupedWeights, dim: int, rank: int, size: int,
               where: str) -> torch.Tensor | GroupedWeights:
    """Rank `rank` of `size`'s share of `matrix` [rows, cols] along dim (ROWS or COLUMNS), in the same form. A cut
    inside a group of a quantised matrix's scales is a ConfigError naming `where` and the fix."""
    if size == 1:
        return matrix
    n = (matrix.q if isinstance(matrix, GroupedWeights) else matrix).shape[dim]
    start, end = rank * n // size, (rank + 1) * n // size
    if not isinstance(matrix, GroupedWeights):
        return matrix.narrow(dim, start, end - start)
    try:
        return matrix.rows(start, end) if dim == ROWS else matrix.columns(start, end)
    except ValueError as e:
        raise ConfigError(f"{where}: tensor_parallel_size {size} cuts its {n} inputs into {n // size} a rank, which "
                          f"does not fit its quantisation groups: {e}; use a tensor_parallel_size that does") from None
