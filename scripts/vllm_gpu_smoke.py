# ruff: noqa: E402  (vLLM reads VLLM_ENABLE_V1_MULTIPROCESSING when imported: set first)
"""GPU smoke of s2attn's vLLM plugin: greedy tokens of vLLM (CUDA, piecewise graphs) against
transformers' dense-mask reference attention on the same GPU, float32 and bfloat16.

On the GPU machine, with vLLM 0.26.0 installed as docs/integrations.md says:
    VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=/tmp/site OUT=$OUT python3 scripts/vllm_gpu_smoke.py
(the GPU sampler imports flashinfer otherwise). Writes $OUT/vllm_smoke.json and prints the
distributions Python imported, for the wheel list of scripts/vllm_gpu_wheels.sh."""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import s2attn.integrations.transformers as s2hf

out_dir = os.environ.get("OUT", "/tmp")
path = "/tmp/hhst_tiny"
cfg = LlamaConfig(
    vocab_size=512,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
)
s2hf.configure(cfg, block_size=64, local_blocks=2, vert_stride=4, dense_layers=[1])
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).eval()
model.save_pretrained(path)
gen = torch.Generator().manual_seed(1)
prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (300, 1000, 77)]
NEW = 32
results = {}


def hf_tokens(dtype):
    m = LlamaForCausalLM.from_pretrained(path, torch_dtype=dtype).cuda().eval()
    m.set_attn_implementation(s2hf.REFERENCE_IMPLEMENTATION)
    outs = []
    with torch.no_grad():
        for ids in prompts:
            seq = m.generate(
                torch.tensor([ids], device="cuda"),
                max_new_tokens=NEW,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(seq[0, len(ids) :].tolist())
    del m
    torch.cuda.empty_cache()
    return outs


from vllm import LLM, SamplingParams

for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
    ref = hf_tokens(dtype)
    t = time.time()
    try:
        llm = LLM(
            path,
            skip_tokenizer_init=True,
            dtype=dtype_name,
            block_size=64,
            max_model_len=4096,
            gpu_memory_utilization=0.25,
            max_num_batched_tokens=256,
            seed=0,
        )
        impls = llm.apply_model(
            lambda mod: [type(layer.self_attn.attn.impl).__name__ for layer in mod.model.layers]
        )[0]
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
        )
        got = [list(o.outputs[0].token_ids) for o in outs]
        agree = [sum(a == b for a, b in zip(x, y)) / NEW for x, y in zip(got, ref)]
        first_diff = [
            next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
            for x, y in zip(got, ref)
        ]
        results[dtype_name] = dict(
            equal=got == ref,
            agreement=agree,
            first_diff=first_diff,
            impls=impls,
            seconds=time.time() - t,
        )
        del llm
    except Exception as exc:
        import traceback

        traceback.print_exc()
        results[dtype_name] = dict(error=f"{type(exc).__name__}: {exc}"[:2000])
    print(dtype_name, json.dumps(results[dtype_name]), flush=True)
    import gc

    gc.collect()
    torch.cuda.empty_cache()
json.dump(results, open(os.path.join(out_dir, "vllm_smoke.json"), "w"), indent=1)
import importlib.metadata as md

pd = md.packages_distributions()
tops = sorted({m.split(".")[0] for m in list(sys.modules)})
print("DISTS", json.dumps(sorted({d for t in tops for d in pd.get(t, [])})))
