import sys, types, importlib, json, os
import torch, triton
pkg = types.ModuleType("fa"); pkg.__path__ = ["torch-ext/flash_attn"]; sys.modules["fa"] = pkg
bwd = importlib.import_module("fa._triton_bwd")
AttnParams = importlib.import_module("fa._params").AttnParams
dev = torch.device("cuda")
print("SMs", torch.cuda.get_device_properties(dev).multi_processor_count, flush=True)
rows = []
for B, S, causal in ((4, 4096, True), (1, 16384, True), (4, 4096, False)):
    Hq, Hkv, D = 32, 1, 128
    torch.manual_seed(0)
    q = torch.randn(B, S, Hq, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, S, Hkv, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k); dout = torch.randn_like(q); out = torch.randn_like(q)
    lse = torch.randn(B, Hq, S, device=dev) + 8.0
    params = AttnParams(softmax_scale=D ** -0.5, causal=causal, window_left=-1,
                        window_right=0 if causal else -1, softcap=0.0, dropout_p=0.0, seed=0,
                        deterministic=True, max_seqlen_q=S, max_seqlen_k=S)
    flops = 2.5 * 4 * B * S * S * Hq * D / (2 if causal else 1)
    res = {}
    for gs in (1, None, 4, 16):
        g = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]
        f = lambda: bwd.backward(dout, q, k, v, out, lse, *g, None, cu_seqlens_q=None,
                                 cu_seqlens_k=None, s_aux=None, alibi_slopes=None,
                                 params=params, group_splits=gs)
        f(); torch.cuda.synchronize()
        ms = triton.testing.do_bench(f, warmup=50, rep=300)
        res[gs] = [t.clone() for t in g]
        f(); same = all(torch.equal(a, b) for a, b in zip(res[gs], g))
        row = dict(B=B, S=S, causal=causal, group_splits=gs, ms=round(ms, 3),
                   tflops=round(flops / ms / 1e9, 1), bitwise_repeat=same)
        if gs != 1:
            row["dk_rel_vs_unsplit"] = float((res[gs][1].float() - res[1][1].float()).norm()
                                             / res[1][1].float().norm())
            row["dv_rel_vs_unsplit"] = float((res[gs][2].float() - res[1][2].float()).norm()
                                             / res[1][2].float().norm())
        print(json.dumps(row), flush=True); rows.append(row)
    del q, k, v, dout, out, lse, res, g
open(os.environ["OUT"] + "/time_split.jsonl", "w").write("\n".join(map(json.dumps, rows)))
