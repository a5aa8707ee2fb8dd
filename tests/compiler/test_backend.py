"""The backend's Inductor settings per graph."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from tilefx.compiler.backend import STATIC_MIN_CHUNK, Backend, _static
from tilefx.compiler.options import CompileOptions


def test_only_graphs_of_known_sizes_keep_small_loops_on_one_thread():
    shape_env = ShapeEnv()
    tokens = shape_env.create_unbacked_symint()
    with FakeTensorMode(shape_env=shape_env):
        dynamic = torch.empty(1, tokens, 64)
        static = torch.empty(1, 1, 64)
    assert _static([static, 3])
    assert not _static([static, dynamic])
    assert not _static([static, tokens])

    backend = Backend(CompileOptions())
    assert backend.inductor_config(static_shapes=True)["cpp.min_chunk_size"] == STATIC_MIN_CHUNK
    # a dynamic dim's hint (the warm-up's length) must not make a long prompt's kernels serial
    assert "cpp.min_chunk_size" not in backend.inductor_config(static_shapes=False)
