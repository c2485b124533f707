"""HuggingFace transformers: a tiny Llama (random weights, no download) generating through s2attn
with the evicting S2Cache matches the same model on the dense-mask reference attention, token for
token, for HHST layouts (dense first layer, S2 after), left-padded batches and transformers' own
DynamicCache."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import (
    DEVICE,
    ON_GPU,
    assert_fails_on_the_device,
    run_to_the_device_assertion,
    skip_without_gpu,
    tiny_llama_config,
)

transformers = pytest.importorskip("transformers")
s2hf = pytest.importorskip("s2attn.integrations.transformers")

PROMPT = 70
NEW_TOKENS = 20


def tiny_llama(dense_layers=(0,), num_layers=3, dtype=torch.float32):
    """4 query / 2 KV heads of dim 16, blocks of 16: local 2 blocks, stripes every 3."""
    config = tiny_llama_config(num_layers)
    s2hf.configure(
        config, block_size=16, local_blocks=2, vert_stride=3, dense_layers=list(dense_layers)
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(DEVICE, dtype).eval()
    reference = transformers.LlamaForCausalLM(copy.deepcopy(config)).to(DEVICE, dtype).eval()
    reference.load_state_dict(model.state_dict())
    reference.set_attn_implementation(s2hf.REFERENCE_IMPLEMENTATION)
    return model, reference


def generate(model, ids, mask, new_tokens=NEW_TOKENS, **kwargs):
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
            **kwargs,
        )
    return out.sequences, torch.stack(out.scores)


def assert_same_generation(got, want):
    """Token for token, in float32 (in bfloat16 a near-tie may round either way)."""
    tokens, scores = got
    ref_tokens, ref_scores = want
    err = ((scores - ref_scores).norm() / ref_scores.norm()).item()
    print(f"logits relative error {err:.2e}; tokens {tokens[:, -scores.shape[0] :].tolist()}")
    assert err < 1e-4
    assert torch.equal(tokens, ref_tokens), "greedy tokens differ from the reference attention"


def compile_layers_counted(model) -> list:
    """``compile_layers(model)`` (fullgraph) with a backend that runs each graph as traced and
    records it with its example inputs, to count graphs and read their shapes."""
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    s2hf.compile_layers(model, backend=counting_backend, fullgraph=True)
    return graphs


def test_compile_layers_compiles_one_graph_per_kind_of_layer():
    """compile_layers compiles each decoder layer on its own, and the three S2 layers share one
    graph (the dense layer has its own): the attention reads the pattern prepare bound to its
    module, not its layer_idx, on which the compiler would specialise each layer. The compiled
    model's logits and gradients equal the dense-mask reference's (float32, 1e-4)."""
    model, reference = tiny_llama(dense_layers=(1,), num_layers=4)
    graphs = compile_layers_counted(model)
    assert [layer.self_attn.s2attn_pattern for layer in model.model.layers] == [
        s2hf._attention_pattern(model.config, i) for i in range(4)
    ]
    ids = torch.randint(2, 128, (2, PROMPT), device=DEVICE)
    logits = []
    for m in (model, reference):
        out = m(ids, use_cache=False).logits
        out.float().square().mean().backward()
        logits.append(out.detach())
    assert len(graphs) == 2, f"{len(graphs)} graphs for 4 layers of two kinds"

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(*logits) < 1e-4
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert rel(p.grad, q.grad) < 1e-4, name


def test_compile_layers_keeps_shapes_static():
    """Each layer kind at each length gets a graph of its own, with no symbolic size: automatic
    dynamic shapes would have made the pattern's key (which differs between the two kinds) and
    the sequence length symbolic after the first change, and served later lengths from one
    generic graph per kind."""
    model, _ = tiny_llama(dense_layers=(1,), num_layers=4)
    graphs = compile_layers_counted(model)
    with torch.no_grad():
        for length in (PROMPT, PROMPT - 1, PROMPT - 2):
            model(torch.randint(2, 128, (2, length), device=DEVICE), use_cache=False)
    assert len(graphs) == 6, f"{len(graphs)} graphs for two kinds of layer at three lengths"
    symbolic = [
        x for _, inputs in graphs for x in inputs
        if isinstance(x, torch.SymInt)
        or (isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in x.shape))
    ]  # fmt: skip
    assert not symbolic, symbolic


def test_compile_layers_needs_a_layer_list():
    model, _ = tiny_llama()
    with pytest.raises(ValueError, match="no decoder layer list"):
        s2hf.compile_layers(torch.nn.Sequential(model.model.embed_tokens))


def test_generate_with_s2_cache_matches_reference():
    model, reference = tiny_llama()
    assert model.config.s2attn["layer_types"] == ["dense", "s2", "s2"]
    ids = torch.randint(2, 128, (1, PROMPT), device=DEVICE)
    mask = torch.ones_like(ids)
    cache = s2hf.S2Cache(model.config)  # no device: the pages go where the first keys are
    assert not any(layer.is_initialized for layer in cache.layers)
    got = generate(model, ids, mask, past_key_values=cache)
    assert_same_generation(got, generate(reference, ids, mask))
    assert all(layer.paged.k_pages.device == model.device for layer in cache.layers)
    report = cache.memory_report()
    assert report["tokens"] == 3 * (PROMPT + NEW_TOKENS - 1)  # the last token is never attended
    s2_layers = [layer.paged for layer in cache.layers[1:]]
    assert all(0 < p.live_bytes() < p.dense_bytes() for p in s2_layers)
    assert all(p.live_pages <= p.needed_pages() + p.num_kv_heads for p in s2_layers)
    dense_layer = cache.layers[0].paged  # keeps every block
    assert dense_layer.live_pages == 2 * -(-(PROMPT + NEW_TOKENS - 1) // 16)


def test_generate_with_static_s2_cache_matches_reference():
    """S2Cache(static=True): fixed pages in every layer (a ring for the S2 layers' windows),
    left-padded prompts, greedy generation over several block boundaries, token for token."""
    model, reference = tiny_llama()
    lengths = [PROMPT, 45]
    ids = torch.randint(2, 128, (2, PROMPT), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, : PROMPT - lengths[1]] = 0
    ids[1, : PROMPT - lengths[1]] = 0
    cache = s2hf.S2Cache(model.config, static=True)
    got = generate(model, ids, mask, new_tokens=30, past_key_values=cache)
    assert_same_generation(got, generate(reference, ids, mask, new_tokens=30))
    s2_layer = cache.layers[1].paged
    assert s2_layer.static and s2_layer.static_plan()["ring"] > 0
    assert s2_layer.num_pages < cache.layers[0].paged.num_pages  # the dense layer: every block


def counting_compile_config(compile_graph=None):
    """A ``CompileConfig`` for ``generate`` that compiles on any device (transformers compiles on
    GPUs only by default) with ``compile_graph`` (default aot_eager), and the list each compiled
    graph is appended to, to count retraces."""
    from torch._dynamo.backends.debugging import aot_eager
    from transformers.generation.configuration_utils import CompileConfig

    compile_graph = compile_graph or aot_eager
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return compile_graph(gm, example_inputs)

    config = CompileConfig(fullgraph=True, backend=counting_backend, mode=None)
    config._compile_all_devices = True
    return config, graphs


@pytest.mark.parametrize(
    "compiler",
    [
        "aot_eager",
        pytest.param(
            "inductor",
            marks=pytest.mark.skipif(
                DEVICE == "cpu",
                reason="Inductor's C++ build of the CPU kernels takes over a minute; the GPU "
                "suite compiles the same step",
            ),
        ),
    ],
)
def test_compiled_decode_over_static_cache_matches_reference(compiler):
    """generate compiles its decode step for a static S2Cache (the cache says it is compileable):
    the whole step traces into one graph (fullgraph) whose attention is one s2attn operator of
    device work, so the graph serves every step without retracing (the padding mask comes at the
    cache's fixed length, not growing by a token per step); tokens equal the reference's,
    and the host lengths catch up with the device's afterwards. Inductor runs the operator in
    place on the cache's tensors (a copy would lose the pages' writes)."""
    from torch._inductor.compile_fx import compile_fx

    compile_graph = {
        "aot_eager": torch._dynamo.backends.debugging.aot_eager,
        "inductor": compile_fx,
    }

    model, reference = tiny_llama()
    lengths, new_tokens = [PROMPT, 45], 30
    ids = torch.randint(2, 128, (2, PROMPT), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, : PROMPT - lengths[1]] = 0
    ids[1, : PROMPT - lengths[1]] = 0
    compile_config, graphs = counting_compile_config(compile_graph[compiler])
    cache = s2hf.S2Cache(model.config, static=True)
    assert cache.is_compileable
    torch._dynamo.reset()
    got = generate(model, ids, mask, new_tokens=new_tokens, past_key_values=cache,
                   compile_config=compile_config)  # fmt: skip
    assert len(graphs) == 1, f"{len(graphs)} graphs for {new_tokens - 1} decode steps"
    op = torch.ops.s2attn.static_decode
    assert any(node.target in (op, op.default) for gm in graphs for node in gm.graph.nodes)
    assert_same_generation(got, generate(reference, ids, mask, new_tokens=new_tokens))
    # The prefill ran eagerly, then new_tokens - 1 decode steps in the graph; the last token is
    # never attended.
    assert cache.layers[1].paged.lengths == [n + new_tokens - 1 for n in lengths]  # synced
    assert cache.get_seq_length() == PROMPT + new_tokens - 1
    cache.crop(-3)
    assert cache.layers[2].paged.lengths == [n + new_tokens - 4 for n in lengths]


def test_compiled_decode_refuses_a_step_past_the_static_cache():
    """generate with a compiled decode step over a static S2Cache too short for the request:
    the steps that fit run in one graph, and the one past the cache is refused before it runs
    (when generate asks the cache for its mask), naming the length it needs and the cache's
    max_seq_len; every layer holds exactly max_seq_len tokens, none written past it."""
    model, _ = tiny_llama()
    compile_config, graphs = counting_compile_config()
    cache = s2hf.S2Cache(model.config, static=True, max_seq_len=48)
    ids = torch.randint(2, 128, (1, 40), device=DEVICE)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="would hold 49 tokens, past the cache's max_seq_len 48"):
        generate(model, ids, torch.ones_like(ids), new_tokens=20, past_key_values=cache,
                 compile_config=compile_config)  # fmt: skip
    # At most transformers' own retrace (its first two decode calls differ in their keywords),
    # none per step.
    assert len(graphs) <= 2, f"{len(graphs)} graphs for 8 decode steps"
    for layer in cache.layers:
        assert layer.paged.lengths == [48] and layer.paged.seq_lens.tolist() == [48]


def test_compiled_decode_checks_the_static_cache_once_per_step(monkeypatch):
    """The device check that a compiled step fits the static cache (torch._assert_async, two
    launches) runs once per step, in the first layer's operator, not in every layer's: counted
    at run time, where the operator's body calls it, over several steps of a 3-layer model."""
    model, _ = tiny_llama()
    compile_config, graphs = counting_compile_config()
    cache = s2hf.S2Cache(model.config, static=True)
    asserts = []
    assert_async = torch._assert_async

    def counting_assert(*args):
        asserts.append(args)
        return assert_async(*args)

    monkeypatch.setattr(torch, "_assert_async", counting_assert)
    ids = torch.randint(2, 128, (1, 40), device=DEVICE)
    torch._dynamo.reset()
    new_tokens = 8
    generate(model, ids, torch.ones_like(ids), new_tokens=new_tokens, past_key_values=cache,
             compile_config=compile_config)  # fmt: skip
    assert graphs, "the decode step did not compile"
    assert [layer.checks_room for layer in cache.layers] == [True, False, False]
    # The prefill runs eagerly (checked on the host); each decode step runs the graph once.
    assert len(asserts) == new_tokens - 1, f"{len(asserts)} checks for {new_tokens - 1} steps"


def test_compiled_decode_past_the_static_cache_fails_before_any_layer_writes():
    """A compiled decode step past the static cache's end whose host check did not run (a graph
    replayed as is: here the model's own compiled forward, which checks nothing on the host)
    fails the first layer's device check, before any layer writes: every layer keeps its pages
    and lengths. Inductor, which runs the operators in place on the cache's tensors (aot_eager
    would run them on copies, written back only at the graph's end). On a GPU the step runs in a
    child process: a CUDA assertion ends its context."""
    if ON_GPU:
        assert_fails_on_the_device(__file__, "_decode_past_the_static_cache")
    else:
        _decode_past_the_static_cache()


def _decode_past_the_static_cache(child: bool = False):
    model, _ = tiny_llama()
    cache = s2hf.S2Cache(model.config, static=True, max_seq_len=48)
    ids = torch.randint(2, 128, (1, 46), device=DEVICE)
    forward = torch.compile(model, backend="inductor", fullgraph=True)
    torch._dynamo.reset()

    def decode(token, position):
        at = torch.tensor([position], device=DEVICE)
        return forward(token, past_key_values=cache, cache_position=at, position_ids=at[None])

    with torch.no_grad():
        token = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)  # eager prefill
        for position in (46, 47):
            token = decode(token, position).logits[:, -1:].argmax(-1)
        held = [
            (layer.paged.k_pages.clone(), layer.paged.v_pages.clone()) for layer in cache.layers
        ]
        if child:
            return run_to_the_device_assertion(lambda: decode(token, 48))
        with pytest.raises(RuntimeError, match="1 tokens past the static cache's 48"):
            decode(token, 48)
    for layer, (k_pages, v_pages) in zip(cache.layers, held):
        assert layer.paged.seq_lens.tolist() == [48]
        assert torch.equal(layer.paged.k_pages, k_pages) and torch.equal(
            layer.paged.v_pages, v_pages
        )


def test_compiled_decode_serves_a_second_request_from_its_graph():
    """One static S2Cache serving two requests (reset between, as a server reuses it): the
    second generate runs the decode graph compiled for the first (no retrace), the reset finds
    the host caught up with the device, and both requests' tokens equal the reference's."""
    model, reference = tiny_llama()
    compile_config, graphs = counting_compile_config()
    cache = s2hf.S2Cache(model.config, static=True)
    torch._dynamo.reset()
    for request in range(2):
        ids = torch.randint(2, 128, (1, PROMPT - 10 * request), device=DEVICE)
        mask = torch.ones_like(ids)
        cache.reset()
        got = generate(model, ids, mask, new_tokens=12, past_key_values=cache,
                       compile_config=compile_config)  # fmt: skip
        assert_same_generation(got, generate(reference, ids, mask, new_tokens=12))
        assert cache.layers[1].paged.lengths == [ids.shape[1] + 11]
        if request == 0:
            compiled = len(graphs)
    assert compiled >= 1 and len(graphs) == compiled, "the second request retraced"


def test_left_padded_batch_matches_reference():
    model, reference = tiny_llama(dense_layers=(), num_layers=2)
    lengths = [PROMPT, 45]
    ids = torch.randint(2, 128, (2, PROMPT), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, : PROMPT - lengths[1]] = 0
    ids[1, : PROMPT - lengths[1]] = 0
    cache = s2hf.S2Cache(model.config)
    got = generate(model, ids, mask, new_tokens=10, past_key_values=cache)
    assert_same_generation(got, generate(reference, ids, mask, new_tokens=10))
    held = [n + 10 - 1 for n in lengths]
    assert cache.layers[0].paged.lengths == held  # each sequence unpadded in the cache


def padded_batch(lengths, seq, seed=0):
    """Left-padded ids, mask and position ids (each sequence counts from its first real token)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 128, (len(lengths), seq), generator=gen).to(DEVICE)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, seq - n :] = 1
        ids[b, : seq - n] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def test_left_padded_forward_without_cache_matches_each_sequence_alone():
    """Training and cache-free forwards of a left-padded batch: every real token's logits equal
    those of its sequence run alone through the reference attention; padded rows attend
    nothing. Lengths span blocks and leave one sequence unpadded and one a single block."""
    model, reference = tiny_llama(num_layers=3)
    seq, lengths = 80, [80, 37, 16, 1]
    ids, mask, positions = padded_batch(lengths, seq)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        for b, n in enumerate(lengths):
            alone = reference(input_ids=ids[b : b + 1, seq - n :]).logits[0]
            torch.testing.assert_close(got[b, seq - n :], alone, rtol=1e-4, atol=1e-4)
        both = reference(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(got, both, rtol=1e-4, atol=1e-4)  # the reference path agrees


def test_saved_hhst_checkpoint_declares_its_own_architecture(tmp_path):
    """An HHST checkpoint's config names S2LlamaForCausalLM (a server that picks models by that
    name refuses it without s2attn, rather than serve a dense Llama); transformers loads it by
    model_type as a Llama with its S2 layers. A plain Llama keeps its name."""
    import json

    model, _ = tiny_llama()
    model.save_pretrained(tmp_path / "hhst")
    saved = json.loads((tmp_path / "hhst" / "config.json").read_text())
    assert saved["architectures"] == [s2hf.HHST_ARCHITECTURE]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hhst").to(DEVICE)
    assert isinstance(loaded, transformers.LlamaForCausalLM)
    assert loaded.config.s2attn == model.config.s2attn
    ids = torch.randint(2, 128, (1, 40), device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    # A config saved alone (no model, no architecture named): vLLM would serve it as its own
    # dense Llama unless it names S2LlamaForCausalLM.
    model.config.save_pretrained(tmp_path / "config_only")
    model.config.architectures = None
    model.config.save_pretrained(tmp_path / "config_only")
    saved = json.loads((tmp_path / "config_only" / "config.json").read_text())
    assert saved["architectures"] == [s2hf.HHST_ARCHITECTURE]
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        vocab_size=64))  # fmt: skip
    plain.save_pretrained(tmp_path / "plain")
    saved = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLM"]


def test_transformers_dynamic_cache_through_s2attn():
    """Without S2Cache, s2attn attends over the whole context transformers' cache returns."""
    model, reference = tiny_llama(num_layers=2)
    ids = torch.randint(2, 128, (1, PROMPT), device=DEVICE)
    mask = torch.ones_like(ids)
    want = generate(reference, ids, mask, new_tokens=4)
    got = generate(model, ids, mask, new_tokens=4)
    assert_same_generation(got, want)


@skip_without_gpu
def test_bfloat16_generation_on_gpu():
    """bfloat16 through the kernels: the prefill's logits match the reference's (bf16 accuracy)."""
    model, reference = tiny_llama(dtype=torch.bfloat16)
    ids = torch.randint(2, 128, (2, 200), device=DEVICE)  # the patterns cover 256 positions
    mask = torch.ones_like(ids)
    tokens, scores = generate(model, ids, mask, past_key_values=s2hf.S2Cache(model.config))
    ref_tokens, ref_scores = generate(reference, ids, mask)
    err = ((scores[0].float() - ref_scores[0].float()).norm() / ref_scores[0].float().norm()).item()
    print(f"first-step logits relative error {err:.2e}")
    assert err < 2e-2
    assert tokens.shape == ref_tokens.shape


def test_static_cache_fixes_the_address_of_what_the_decode_step_writes():
    """Inductor runs a compiled graph that mutates an input without a fixed address without CUDA
    graphs (reduce-overhead then silently gives a slower step: 14.8 ms against 8.1 for a 7B step
    at 128k on an H100): every tensor that s2attn::static_decode writes must be marked static by
    each layer of a static S2Cache."""
    from s2attn.inference import decode_op  # noqa: F401 (registers the operator)

    model, _ = tiny_llama()
    cache = s2hf.S2Cache(model.config, static=True)
    with torch.no_grad():
        model(torch.randint(2, 128, (1, PROMPT), device=DEVICE), past_key_values=cache)
    schema = torch.ops.s2attn.static_decode.default._schema
    written = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
    assert set(written) == {"k_pages", "v_pages", "seq_lens", "split_counters"}
    for i, layer in enumerate(cache.layers):
        for name in written:
            marked = getattr(getattr(layer.paged, name), "_dynamo_static_input_type", None)
            assert marked is not None, f"layer {i}: {name} is not marked static"


def test_misuse_is_reported():
    model, _ = tiny_llama(num_layers=2)
    ids = torch.randint(2, 128, (1, 20), device=DEVICE)
    model.set_attn_implementation("sdpa")
    cache = s2hf.S2Cache(model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)  # sdpa sees only the new keys
        with pytest.raises(RuntimeError, match="attn_implementation='s2attn'"):
            model(ids[:, :1], past_key_values=cache, use_cache=True)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    with pytest.raises(ValueError, match="dense_layers"):
        s2hf.configure(config, dense_layers=[5])
    with pytest.raises(ValueError, match="configure"):
        s2hf.S2Cache(config)


def beam_search(model, ids, mask, num_beams, new_tokens=8, **kwargs):
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            num_beams=num_beams,
            num_return_sequences=num_beams,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
            **kwargs,
        )
    return out.sequences, out.sequences_scores


@pytest.mark.parametrize("num_beams, padded", [(2, False), (3, True)])
def test_beam_search_with_s2_cache_matches_reference(num_beams, padded):
    """Beams share their common past's pages and copy a shared page before writing into it: the
    beams, their order and scores are those of transformers' DynamicCache on the reference."""
    model, reference = tiny_llama(num_layers=2)
    batch = 2 if padded else 1
    ids = torch.randint(2, 128, (batch, 40), device=DEVICE)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :13] = 0
        ids[1, :13] = 0
    cache = s2hf.S2Cache(model.config)
    tokens, scores = beam_search(model, ids, mask, num_beams, past_key_values=cache)
    ref_tokens, ref_scores = beam_search(reference, ids, mask, num_beams)
    print(f"beams {tokens[:, ids.shape[1] :].tolist()}, scores {scores.tolist()}")
    assert torch.equal(tokens, ref_tokens), "beams differ from the reference attention"
    assert torch.allclose(scores, ref_scores, rtol=1e-4, atol=1e-5)
    for layer in cache.layers:  # every page held is counted, every other page is free
        paged = layer.paged
        table = paged._table[paged._table >= 0].long()
        counts = torch.bincount(table, minlength=paged.num_pages)
        assert torch.equal(counts.to(torch.int32), paged.pool.holders())
        assert paged.live_pages == int((counts > 0).sum())


def test_cache_reuse_crop_reset_and_two_caches_match_reference():
    """Continuing a request in its cache, after a crop (rejected tokens), after a reset (a new
    request) and with two caches used alternately gives the reference's tokens each time; a crop
    past what the cache still holds raises and leaves it as it was."""
    model, reference = tiny_llama(num_layers=2)
    ids = torch.randint(2, 128, (2, 36), device=DEVICE)
    mask = torch.ones_like(ids)
    first, second = s2hf.S2Cache(model.config), s2hf.S2Cache(model.config)
    a, _ = generate(model, ids, mask, new_tokens=4, past_key_values=first)
    b, _ = generate(model, ids[:1], mask[:1], new_tokens=2, past_key_values=second)
    a, _ = generate(model, a, torch.ones_like(a), new_tokens=3, past_key_values=first)
    b, _ = generate(model, b, torch.ones_like(b), new_tokens=2, past_key_values=second)
    assert torch.equal(a, generate(reference, ids, mask, new_tokens=7)[0])
    assert torch.equal(b, generate(reference, ids[:1], mask[:1], new_tokens=4)[0])
    # Crop the last 5 tokens and continue from the 3 tokens before the end of `a`.
    first.crop(-5)
    assert first.get_seq_length() == a.shape[1] - 1 - 5
    c, _ = generate(model, a[:, :-3], torch.ones_like(a[:, :-3]), new_tokens=3,
                    past_key_values=first)  # fmt: skip
    assert torch.equal(c, generate(reference, a[:, :-3], torch.ones_like(a[:, :-3]), 3)[0])
    before = [(layer.paged.lengths, layer.paged.live_pages) for layer in first.layers]
    with pytest.raises(ValueError, match="already evicted"):  # in the S2 layer, not the dense one
        first.crop(-(c.shape[1] - 2))
    assert [(layer.paged.lengths, layer.paged.live_pages) for layer in first.layers] == before
    first.reset()
    d, _ = generate(model, ids[:, 5:], mask[:, 5:], new_tokens=3, past_key_values=first)
    assert torch.equal(d, generate(reference, ids[:, 5:], mask[:, 5:], new_tokens=3)[0])


def test_cache_hand_off_lasts_one_step():
    """S2Cache hands each layer's step to the attention through that step's keys only: a forward
    without a cache, after generating through an S2Cache and after an S2Cache step that no
    's2attn' attention took (the model on SDPA then), attends over its own keys as the reference
    does."""
    model, reference = tiny_llama(num_layers=2)
    ids = torch.randint(2, 128, (1, 40), device=DEVICE)
    mask = torch.ones_like(ids)
    generate(model, ids, mask, new_tokens=3, past_key_values=s2hf.S2Cache(model.config))
    with torch.no_grad():
        want = reference(ids, use_cache=False).logits
        got = model(ids, use_cache=False).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        model.set_attn_implementation("sdpa")
        model(ids[:, :20], past_key_values=s2hf.S2Cache(model.config), use_cache=True)
        model.set_attn_implementation(s2hf.ATTN_IMPLEMENTATION)
        got = model(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_configure_takes_a_config_object_of_a_supported_family():
    """A dict is refused with what configure takes; a GPT-2 config (attention dropout, no RoPE)
    is refused by configure itself, naming the families it supports, not later in forward."""
    with pytest.raises(TypeError, match=r"PreTrainedConfig such as LlamaConfig\), got dict"):
        s2hf.configure({"num_hidden_layers": 2, "hidden_size": 64})
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4)
    with pytest.raises(ValueError) as info:
        s2hf.configure(gpt2, block_size=16, local_blocks=2, vert_stride=3)
    message = str(info.value)
    print(message)
    assert "GPT2Config (model_type 'gpt2') is not a supported model family" in message
    assert "Llama, Mistral, Qwen2, Qwen3" in message
    assert not hasattr(gpt2, "s2attn")


@pytest.mark.parametrize("dense_layers", [True, False, "2", 1.5, {0: 1}])
def test_configure_refuses_dense_layers_that_are_no_count_or_list(dense_layers):
    config = tiny_llama_config(2)
    with pytest.raises(TypeError, match=r"dense_layers must be a count of dense layers \(an int"):
        s2hf.configure(config, dense_layers=dense_layers)
    assert not hasattr(config, "s2attn")
    # A count and a list are taken.
    assert s2hf.configure(config, dense_layers=1).s2attn["layer_types"].count("dense") == 1
    assert s2hf.configure(config, dense_layers=(0, 1)).s2attn["layer_types"] == ["dense"] * 2


@pytest.mark.parametrize("max_seq_len", [-1, 0, True, 64.0])
def test_s2_cache_refuses_a_bad_length_when_built(max_seq_len):
    config = tiny_llama_config(2)
    s2hf.configure(config, block_size=16, local_blocks=2, vert_stride=3, dense_layers=[0])
    with pytest.raises(ValueError, match=r"S2Cache: max_seq_len must be a positive int .* got "):
        s2hf.S2Cache(config, max_seq_len=max_seq_len)
    assert s2hf.S2Cache(config, max_seq_len=64) is not None


@pytest.mark.parametrize("model_type", sorted(set(s2hf.SUPPORTED_MODEL_TYPES) - {"llama"}))
def test_every_supported_family_runs_on_the_kernels_as_on_the_reference(model_type):
    """Each family configure accepts besides Llama (tested throughout this file): one forward
    pass of a tiny HHST model through the kernels equals the dense-mask reference's."""
    auto = transformers.AutoConfig.for_model(
        model_type,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        max_position_embeddings=256,
    )
    s2hf.configure(auto, block_size=16, local_blocks=2, vert_stride=3, dense_layers=[0])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(auto).to(DEVICE).eval()
    reference = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(auto)).to(DEVICE)
    reference.load_state_dict(model.state_dict())
    reference.eval().set_attn_implementation(s2hf.REFERENCE_IMPLEMENTATION)
    ids = torch.randint(2, 128, (2, 80), device=DEVICE)
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    err = ((got - want).norm() / want.norm()).item()
    print(f"{model_type}: relative error of the logits {err:.1e}")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
