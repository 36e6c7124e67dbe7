"""Allocation traces of a transformer training step, as (op, id, size) rows:
op 0 allocates `size` bytes under `id`, op 1 frees `id`.

Two sources: `record_torch_gpt2` records the real trace of a PyTorch GPT-2 step
on the GPU (through torch.cuda.memory._record_memory_history), and
`synthetic_gpt2` builds one from the model's shapes where no GPU is present.
"""

from __future__ import annotations

import numpy as np


class TraceBuilder:
    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int]] = []
        self.next_id = 0

    def alloc(self, nbytes: int) -> int:
        i = self.next_id
        self.next_id += 1
        self.rows.append((0, i, int(nbytes)))
        return i

    def free(self, i: int) -> None:
        self.rows.append((1, i, 0))

    def array(self) -> np.ndarray:
        return np.asarray(self.rows, dtype=np.int64).reshape(-1, 3)


def synthetic_gpt2(n_layer=12, n_embd=768, n_head=12, vocab=50257, batch=16, seq=1024,
                   act_bytes=2, steps=2) -> np.ndarray:
    """A GPT-2 training step's allocations from its shapes (bf16 activations, fp32
    master weights, AdamW state): parameters, grads and optimizer state live
    throughout; activations are saved in forward and freed in backward; each op
    allocates its output and frees temporaries."""
    t = TraceBuilder()
    C, BT = n_embd, batch * seq
    shapes = [(vocab, C), (seq, C)]
    for _ in range(n_layer):
        shapes += [(C,), (C,), (C, 3 * C), (3 * C,), (C, C), (C,), (C,), (C,), (C, 4 * C),
                   (4 * C,), (4 * C, C), (C,)]
    shapes += [(C,), (C,)]
    params = [int(np.prod(s)) * 4 for s in shapes]
    persistent = [t.alloc(n) for n in params]  # weights
    persistent += [t.alloc(n) for n in params]  # AdamW m
    persistent += [t.alloc(n) for n in params]  # AdamW v
    for _ in range(steps):
        grads = []
        saved: list[list[int]] = []
        x = t.alloc(BT * C * act_bytes)  # embeddings
        for _ in range(n_layer):
            layer = []
            ln1 = t.alloc(BT * C * act_bytes)
            stats = t.alloc(BT * 8)
            qkv = t.alloc(BT * 3 * C * act_bytes)
            att = t.alloc(BT * C * act_bytes)
            lse = t.alloc(batch * n_head * seq * 4)
            proj = t.alloc(BT * C * act_bytes)
            res = t.alloc(BT * C * act_bytes)
            t.free(proj)
            ln2 = t.alloc(BT * C * act_bytes)
            stats2 = t.alloc(BT * 8)
            fc = t.alloc(BT * 4 * C * act_bytes)
            gelu = t.alloc(BT * 4 * C * act_bytes)
            proj2 = t.alloc(BT * C * act_bytes)
            res2 = t.alloc(BT * C * act_bytes)
            t.free(proj2)
            layer += [x, ln1, stats, qkv, att, lse, res, ln2, stats2, fc, gelu]
            saved.append(layer)
            x = res2
        lnf = t.alloc(BT * C * act_bytes)
        logits = t.alloc(BT * vocab * act_bytes)
        loss = t.alloc(BT * 4)
        t.free(loss)
        dlogits = logits  # the fused classifier writes dlogits in place
        dx = t.alloc(BT * C * act_bytes)
        t.free(dlogits)
        t.free(lnf)
        t.free(x)
        for layer in reversed(saved):
            for _ in range(4):  # weight and bias grads of the layer's four GEMMs
                grads.append(t.alloc(4 * C * C * 4 // 4))
            tmp = t.alloc(BT * 4 * C * act_bytes)
            t.free(tmp)
            dnew = t.alloc(BT * C * act_bytes)
            t.free(dx)
            dx = dnew
            for i in reversed(layer):
                t.free(i)
        t.free(dx)
        for g in grads:  # optimizer step, then zero_grad(set_to_none)
            t.free(g)
    for p in persistent:
        t.free(p)
    return t.array()


def record_torch_gpt2(dtype: str = "bf16", batch: int = 16, seq: int = 1024) -> np.ndarray:
    """Record one PyTorch GPT-2 124M training step (after a warm-up step) on cuda:0."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, C, H):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.fc, self.fc2 = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
            self.H = H

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (z.view(B, T, self.H, C // self.H).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
            return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self, L=12, C=768, H=12, V=50257, T=1024):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
            self.blocks = nn.ModuleList(Block(C, H) for _ in range(L))
            self.lnf = nn.LayerNorm(C)
            self.head = nn.Linear(C, V, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for b in self.blocks:
                x = b(x)
            logits = self.head(self.lnf(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    torch.manual_seed(0)
    model = GPT().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, 50257, (batch, seq), device="cuda")
    amp = torch.autocast("cuda", torch.bfloat16, enabled=dtype == "bf16")

    def step():
        with amp:
            loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    t = TraceBuilder()
    # Weights and AdamW state were allocated before recording: they come first.
    persistent = [
        t.alloc(p.numel() * p.element_size()) for p in model.parameters() for _ in range(3)
    ]
    live: dict[int, int] = {}
    for ev in snap["device_traces"][0]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = t.alloc(ev["size"])
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            t.free(live.pop(ev["addr"]))
    for i in list(live.values()) + persistent:
        t.free(i)
    return t.array()
