"""CPU emulation of the pipelined block-attention kernel (csrc/cuda/block_attention_pipelined.cuh with
the shared pieces of csrc/cuda/block_attention.cuh), checked against `reference.block_attention`.

No GPU runs here, so this file runs the kernel's index arithmetic instead: the host's split policies,
each CTA's work (`cta_work`), the one-thread-per-key slot ring (`slot_of`, `resolve`), the cp.async
copies of each tile into its stage (`load_tile`), the stage / ring / group schedule of the main loop,
the ldmatrix / mma.sync fragment layouts of S = Q K^T and O += P V (as the PTX ISA defines them for
m8n8.x4 and m16n8k16 .row.col), the masks (causal, window, tree bitmasks), the output / partial
stores and the split merge. Each expression is the kernel's, transcribed, with the kernel line it
mirrors (`# pipelined.cuh:N` / `# attention.cuh:N` at the commit that added this file). Pointers
are element offsets into the flattened storage of each input tensor, through its real strides.

Shared memory is emulated with hazard checks: a cp.async lands only at the wait that covers its
group, a read of an element still in flight, a copy into an element read since the last barrier, a
ring entry read in the interval it was written, and a read of never-written shared memory all fail.
The arithmetic is float64 (P is not rounded to the 16-bit type here: this checks indices, not
rounding), so the output matches the reference to fp32 rounding. `test_a_broken_expression_fails`
breaks expressions one at a time and expects a failure.

The second part emulates verify_block's "fused" variant (csrc/cuda/verify.cu): the one-pass
Gumbel-max under random thread interleavings (against reference.target_samples), the per-warp
ballot compaction (exactly the tokens above the edge, each warp's order, the overflow report) and
the radix top-k select (bit for bit the CPU twin's bisection threshold).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from sglang_dflash.ops import reference
from sglang_dflash.ops.testing import make_attention_inputs, make_tree

ROOT = Path(__file__).resolve().parents[1]
LANE = np.arange(32)
GID, TQ = LANE >> 2, LANE & 3  # mma fragment coordinates (pipelined.cuh:115)
E2 = np.arange(2)

# block_attention.cuh's kPipeConfigs: (keys per tile, stages, warps); test_configs_match_the_header.
PIPE_CONFIGS = [(64, 3, 4), (64, 2, 4), (32, 4, 4), (64, 4, 4), (64, 3, 8)]
MAX_SPLITS, MIN_KEYS_PER_SPLIT = 32, 256


def ceil_div(a, b):
    return -(-a // b)


@dataclass
class Pipe:
    """Pipe<D, C> (pipelined.cuh:25-43)."""

    d: int
    config: int

    def __post_init__(self):
        keys, self.stages, self.warps = PIPE_CONFIGS[self.config]
        self.tile = keys if self.d <= 128 else keys // 2
        self.threads, self.rows = 32 * self.warps, 16 * self.warps
        self.ld, self.chunks = self.d + 8, self.d // 8
        self.q_in_registers = self.d <= 128
        self.stage_elems = 2 * self.tile * self.ld
        self.ring_bytes = 8 * 2 * self.stages * self.tile
        self.smem_bytes = self.ring_bytes + 2 * (self.stages * self.stage_elems
                                                 + (0 if self.q_in_registers else self.rows * self.ld))


# ------------------------------------------------------------------------------------------------
# Global memory: every input tensor as its flattened storage, pointers as element offsets.


@dataclass
class Buffers:
    flat: dict = field(default_factory=dict)  # name -> float64 / int64 numpy array of the storage

    def add(self, name, t):
        base = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())
        self.flat[name] = (base.double() if t.is_floating_point() else base.long()).numpy()
        return t.storage_offset()


@dataclass
class Params:
    """AttnParams (attention.cuh:20-43), filled as block_attention.cu's host code fills it."""

    mem: Buffers
    q: int
    k_block: int
    v_block: int
    k_cache: int
    v_cache: int
    table: int
    q_s0: int
    q_s1: int
    kb_s0: int
    kb_s1: int
    vb_s0: int
    vb_s1: int
    kc_s0: int
    kc_s1: int
    vc_s0: int
    vc_s1: int
    table_s0: int
    table_width: int
    table_rows: int
    n_slots: int
    n_rows: int
    pools: np.ndarray
    ctx_lens: np.ndarray
    causal: bool
    block_size: int
    group: int
    kv_heads: int
    q_heads: int
    head_dim: int
    rows: int
    row_tiles: int
    splits: int
    window: int
    split_keys: int
    sm_scale: float
    tree_sees: np.ndarray | None
    tree_words: int
    out: np.ndarray
    part_o: np.ndarray | None
    part_ml: np.ndarray | None
    errors: list


def host_splits(policy, forced, ctas, sms, resident, max_keys):
    """The split count and split_keys of block_attention.cu's host code (block_attention.cu:526-549)."""
    split_keys = 0
    if policy == "shapes":
        splits = min((2 * sms) // ctas, ceil_div(max_keys, MIN_KEYS_PER_SPLIT))
    elif policy == "work":
        splits = min(ceil_div(resident * sms, ctas), ceil_div(max_keys, MIN_KEYS_PER_SPLIT))
        split_keys = MIN_KEYS_PER_SPLIT
    else:
        splits = forced
    return max(1, min(splits, MAX_SPLITS)), split_keys


def make_params(args, block, window, causal, tree_parents, pipe, policy, forced, sms, resident):
    mem = Buffers()
    q, kb, vb, kc, vc = (args[n] for n in ("q", "k_block", "v_block", "k_cache", "v_cache"))
    table = args["req_to_token"]
    n_rows, hq, d = q.shape
    hkv = kb.shape[1]
    group = hq // hkv
    bs = n_rows // block
    rows = block * group
    row_tiles = ceil_div(rows, pipe.rows)
    ctas = bs * hkv * row_tiles
    splits, split_keys = host_splits(policy, forced, ctas, sms, resident, table.shape[1] + block)
    sees, words = None, 0
    if tree_parents is not None:  # tree_sees_kernel's bitmasks, from the reference's ancestor sets
        words = ceil_div(block, 32)
        anc = reference.tree_ancestors(tree_parents).reshape(n_rows, block).numpy()
        sees = np.zeros(n_rows * words, dtype=np.int64)
        for n in range(n_rows):
            for c in np.flatnonzero(anc[n]):
                sees[n * words + c // 32] |= 1 << (c % 32)
    return Params(
        mem=mem, q=mem.add("q", q), k_block=mem.add("k_block", kb), v_block=mem.add("v_block", vb),
        k_cache=mem.add("k_cache", kc), v_cache=mem.add("v_cache", vc), table=mem.add("table", table),
        q_s0=q.stride(0), q_s1=q.stride(1), kb_s0=kb.stride(0), kb_s1=kb.stride(1), vb_s0=vb.stride(0),
        vb_s1=vb.stride(1), kc_s0=kc.stride(0), kc_s1=kc.stride(1), vc_s0=vc.stride(0), vc_s1=vc.stride(1),
        table_s0=table.stride(0), table_width=table.shape[1], table_rows=table.shape[0], n_slots=kc.shape[0],
        n_rows=n_rows, pools=args["req_pool_indices"].numpy().astype(np.int64),
        ctx_lens=args["ctx_lens"].numpy().astype(np.int64), causal=causal, block_size=block, group=group,
        kv_heads=hkv, q_heads=hq, head_dim=d, rows=rows, row_tiles=row_tiles, splits=splits,
        window=-1 if window < 0 else min(window, 1 << 30), split_keys=split_keys, sm_scale=d**-0.5,
        tree_sees=sees, tree_words=words, out=np.full(n_rows * hq * d, np.nan),
        part_o=np.full(splits * n_rows * hq * d, np.nan) if splits > 1 else None,
        part_ml=np.full(splits * n_rows * hq * 2, np.nan) if splits > 1 else None, errors=[],
    ), (ctas, splits)


# ------------------------------------------------------------------------------------------------
# block_attention.cuh's device helpers.


@dataclass
class Work:
    b: int
    h: int
    row0: int
    row_end: int
    ctx: int
    pool: int
    begin: int
    end: int


def cta_work(p: Params, bx, by, rows_per_cta, tile):  # attention.cuh:54-88
    row_tile = bx % p.row_tiles
    bh = bx // p.row_tiles
    b, h = bh // p.kv_heads, bh % p.kv_heads
    row0 = row_tile * rows_per_cta
    row_end = min(p.rows, row0 + rows_per_cta)
    pool, ctx = int(p.pools[b]), int(p.ctx_lens[b])
    if not (0 <= pool < p.table_rows) or not (0 <= ctx <= p.table_width):
        ctx = 0
    i_min, i_max = row0 // p.group, (row_end - 1) // p.group
    lo, hi = 0, ctx + p.block_size
    if p.window > 0:
        lo = max(0, ctx + i_min - p.window + 1)
        hi = min(hi, ctx + i_max + p.window)
    if p.causal:
        hi = min(hi, ctx + i_max + 1)
    splits = p.splits
    if p.split_keys > 0:
        splits = max(1, min(splits, ceil_div(hi - lo, p.split_keys)))
    chunk = ceil_div(ceil_div(hi - lo, splits), tile) * tile
    begin = lo + by * chunk
    return Work(b, h, row0, row_end, ctx, pool, begin, min(hi, begin + chunk))


def visible(p: Params, w: Work, k, i):  # attention.cuh:91-100, vectorised over k and i
    k, i = np.broadcast_arrays(np.asarray(k, dtype=np.int64), np.asarray(i, dtype=np.int64))
    out = k < w.end
    if p.tree_sees is not None:
        c = k - w.ctx
        block_key = (k >= w.ctx) & out  # the kernel returns before the lookup for k >= end
        word = p.tree_sees[np.where(block_key, (w.b * p.block_size + i) * p.tree_words + np.maximum(c, 0) // 32, 0)]
        bit = (word >> (np.maximum(c, 0) % 32)) & 1
        return out & np.where(block_key, bit == 1, True)
    pos = w.ctx + i
    ok = ~np.bool_(p.causal) | (k <= pos)
    if p.window > 0:
        ok &= np.abs(pos - k) < p.window
    return out & ok


def key_slot(p: Params, w: Work, k):  # attention.cuh:103-105
    return int(p.mem.flat["table"][p.table + w.pool * p.table_s0 + k])


def rows_of_key(p: Params, w: Work, k, slot):  # attention.cuh:110-126: ((kind, offset) of K, of V) or None
    if k < w.ctx:
        if not 0 <= slot < p.n_slots:
            p.errors.append(("kAttentionSlot", w.pool, k, slot, p.n_slots))
            return None
        return ("k_cache", p.k_cache + slot * p.kc_s0 + w.h * p.kc_s1), (
            "v_cache", p.v_cache + slot * p.vc_s0 + w.h * p.vc_s1)
    r = w.b * p.block_size + (k - w.ctx)
    return ("k_block", p.k_block + r * p.kb_s0 + w.h * p.kb_s1), ("v_block", p.v_block + r * p.vb_s0 + w.h * p.vb_s1)


def out_offset(p: Params, w: Work, row):  # attention.cuh:136-140
    n = w.b * p.block_size + row // p.group
    hq = w.h * p.group + row % p.group
    return (n * p.q_heads + hq) * p.head_dim


def q_offset(p: Params, w: Work, row):  # attention.cuh:143-147
    n = w.b * p.block_size + row // p.group
    hq = w.h * p.group + row % p.group
    return n * p.q_s0 + hq * p.q_s1


def write_empty_partials(p: Params, w: Work, by):  # attention.cuh:150-157
    for row in range(w.row0, w.row_end):
        base = by * p.n_rows * p.q_heads * p.head_dim + out_offset(p, w, row)
        p.part_ml[base // p.head_dim * 2 : base // p.head_dim * 2 + 2] = (-np.inf, 0.0)


# ------------------------------------------------------------------------------------------------
# Shared memory with hazard checks, and the warp-level instructions.


class HazardError(AssertionError):
    pass


class Smem:
    """The 16-bit stage / Q buffers: values, the cp.async group still writing each element, the
    barrier interval of each element's last read."""

    def __init__(self, n):
        self.val = np.full(n, np.nan)
        self.pending = np.full(n, -1)
        self.read_at = np.full(n, -1)
        self.interval = 0
        self.groups: list[list] = []
        self.open: list = []
        self.landed = 0

    def barrier(self):
        self.interval += 1

    def cp_async16(self, dst, values):
        """dst [n] first elements of 16-byte rows; values [n, 8] (zeros for a zero-fill)."""
        idx = dst[:, None] + np.arange(8)
        if (self.read_at[idx] == self.interval).any():
            raise HazardError("cp.async into shared memory read since the last barrier")
        if (self.pending[idx] >= 0).any():
            raise HazardError("two cp.async copies in flight into one element")
        self.pending[idx] = len(self.groups)
        self.open.append((idx, values))

    def commit(self):
        self.groups.append(self.open)
        self.open = []

    def wait(self, n):
        """cp.async.wait_group n: every group but the newest n has landed."""
        while self.landed < len(self.groups) - n:
            for idx, values in self.groups[self.landed]:
                self.val[idx] = values
                self.pending[idx] = -1
            self.landed += 1

    def read(self, idx):
        if (self.pending[idx] >= 0).any():
            raise HazardError("read of shared memory a cp.async is still writing")
        if np.isnan(self.val[idx]).any():
            raise HazardError("read of shared memory nothing wrote")
        self.read_at[idx] = self.interval
        return self.val[idx]


class Ring:
    """The K / V row-pointer ring (pipelined.cuh:52-53): (buffer, offset) or None per entry."""

    def __init__(self, n, smem: Smem):
        self.k = [None] * n
        self.v = [None] * n
        self.written_at = np.full(n, -1)
        self.read_at = np.full(n, -1)
        self.smem = smem

    def write(self, e, kv):
        if self.read_at[e] == self.smem.interval:
            raise HazardError("ring entry written in the interval it was read")
        self.k[e], self.v[e] = kv if kv is not None else (None, None)
        self.written_at[e] = self.smem.interval

    def read(self, e):
        if self.written_at[e] < 0 or self.written_at[e] == self.smem.interval:
            raise HazardError("ring entry read without a barrier after its write")
        self.read_at[e] = self.smem.interval
        return self.k[e], self.v[e]


def ldmatrix_x4(smem: Smem, addr, trans=False):
    """Four 8x8 matrices, lanes 8j..8j+7 giving the row addresses of matrix j; register j of lane l
    gets (row l/4, columns 2(l%4), +1) of matrix j, or of its transpose (.trans). [4, 32, 2]."""
    mats = smem.read(addr.reshape(4, 8)[..., None] + np.arange(8))  # [matrix, row, column]
    if trans:
        mats = mats.transpose(0, 2, 1)
    return mats[:, (LANE // 4)[:, None], 2 * (LANE % 4)[:, None] + E2]


def mma_16816(d, a, b0, b1):
    """d [4, 32] += A [16 x 16] B [16 x 8] in the m16n8k16 .row.col fragment layouts."""
    A = np.full((16, 16), np.nan)
    for reg, (dr, dc) in enumerate([(0, 0), (8, 0), (0, 8), (8, 8)]):
        A[GID[:, None] + dr, 2 * TQ[:, None] + dc + E2] = a[reg]
    B = np.full((16, 8), np.nan)
    B[2 * TQ[:, None] + E2, GID[:, None]] = b0
    B[2 * TQ[:, None] + 8 + E2, GID[:, None]] = b1
    assert not np.isnan(A).any() and not np.isnan(B).any(), "fragments do not cover the tiles"
    C = A @ B
    d[0] += C[GID, 2 * TQ]
    d[1] += C[GID, 2 * TQ + 1]
    d[2] += C[GID + 8, 2 * TQ]
    d[3] += C[GID + 8, 2 * TQ + 1]


# The fragment addresses (element offsets from the base pointer), one function each so that
# test_a_broken_expression_fails can break them.
def q_fragment_addr(ld, kk):  # attention.cuh:191, load_q_fragment
    return (LANE & 15) * ld + kk * 16 + (LANE >> 4) * 8


def k_fragment_addr(ld, kk, n2):  # attention.cuh:208, tile_scores
    return (n2 * 16 + (LANE >> 4) * 8 + (LANE & 7)) * ld + kk * 16 + ((LANE >> 3) & 1) * 8


def v_fragment_addr(ld, kk, d2):  # attention.cuh:276, tile_pv
    return (kk * 16 + ((LANE >> 3) & 1) * 8 + (LANE & 7)) * ld + d2 * 16 + (LANE >> 4) * 8


def score_key(k0, nt, e):  # attention.cuh:230, the key of s[nt][half * 2 + e]
    return k0 + nt * 8 + 2 * TQ + e


def ring_entry(tile, stages, tile_keys, j):  # pipelined.cuh:77-78, 87-88
    return (tile % stages) * tile_keys + j


def stage_base(tile, pipe: Pipe):  # pipelined.cuh:82, 135
    return (tile % pipe.stages) * pipe.stage_elems


def wait_depth(stages):  # pipelined.cuh:123, cp_async_wait<S - 2>
    return stages - 2


def loaded_tile(t, stages):  # pipelined.cuh:132, the tile iteration t copies
    return t + stages - 1


def prefetched_tile(t, stages):  # pipelined.cuh:153-154, the ring entry iteration t fills
    return t + stages


# ------------------------------------------------------------------------------------------------
# One warp's math (block_attention.cuh's WarpState, tile_scores, tile_softmax, tile_pv, store_rows).


class WarpState:
    def __init__(self, p: Params, w: Work, warp_row0, d):  # attention.cuh:175-184
        self.o = np.zeros((d // 8, 4, 32))
        self.m = [np.full(32, -np.inf), np.full(32, -np.inf)]
        self.l = [np.zeros(32), np.zeros(32)]
        self.brow = [np.minimum(warp_row0 + GID + half * 8, w.row_end - 1) // p.group for half in range(2)]


def tile_scores(smem, kb, d, tile, ld, q_frag):  # attention.cuh:195-213
    s = np.zeros((tile // 8, 4, 32))
    for kk in range(d // 16):
        a = q_frag(kk)
        for n2 in range(tile // 16):
            bk = ldmatrix_x4(smem, kb + k_fragment_addr(ld, kk, n2))
            mma_16816(s[2 * n2], a, bk[0], bk[1])
            mma_16816(s[2 * n2 + 1], a, bk[2], bk[3])
    return s


def tile_softmax(p, w, k0, tile, scale_log2, s, st: WarpState):  # attention.cuh:217-260
    need_mask = k0 + tile > w.end or p.window > 0 or ((p.causal or p.tree_sees is not None) and k0 + tile > w.ctx)
    for half in range(2):
        for nt in range(tile // 8):
            for e in range(2):
                v = s[nt, half * 2 + e] * scale_log2
                if need_mask:
                    v = np.where(visible(p, w, score_key(k0, nt, e), st.brow[half]), v, -np.inf)
                s[nt, half * 2 + e] = v
        mx = s[:, [half * 2, half * 2 + 1]].max(axis=(0, 1))
        mx = mx.reshape(8, 4).max(axis=1).repeat(4)  # the two xor shuffles over the 4 lanes of a row
        m_new = np.maximum(st.m[half], mx)
        sub = np.where(m_new == -np.inf, 0.0, m_new)
        with np.errstate(invalid="ignore"):
            alpha = np.where(st.m[half] == -np.inf, 0.0, np.exp2(st.m[half] - m_new))
        st.m[half] = m_new
        pv = np.exp2(s[:, [half * 2, half * 2 + 1]] - sub)
        s[:, [half * 2, half * 2 + 1]] = pv
        st.l[half] = st.l[half] * alpha + pv.sum(axis=(0, 1))
        st.o[:, [half * 2, half * 2 + 1]] *= alpha


def tile_pv(smem, s, vb, d, tile, ld, st: WarpState):  # attention.cuh:264-281
    for kk in range(tile // 16):
        pa = np.stack([np.stack([s[2 * kk, 0], s[2 * kk, 1]], -1), np.stack([s[2 * kk, 2], s[2 * kk, 3]], -1),
                       np.stack([s[2 * kk + 1, 0], s[2 * kk + 1, 1]], -1),
                       np.stack([s[2 * kk + 1, 2], s[2 * kk + 1, 3]], -1)])
        for d2 in range(d // 16):
            bv = ldmatrix_x4(smem, vb + v_fragment_addr(ld, kk, d2), trans=True)
            mma_16816(st.o[2 * d2], pa, bv[0], bv[1])
            mma_16816(st.o[2 * d2 + 1], pa, bv[2], bv[3])


def store_rows(p: Params, w: Work, warp_row0, by, st: WarpState):  # attention.cuh:285-318
    for half in range(2):
        total = st.l[half].reshape(8, 4).sum(axis=1).repeat(4)
        row = warp_row0 + GID + half * 8
        for lane in np.flatnonzero(row < w.row_end):
            off = out_offset(p, w, int(row[lane]))
            cols = np.arange(p.head_dim // 8) * 8 + 2 * TQ[lane]
            vals = st.o[:, half * 2 : half * 2 + 2, lane]
            if p.splits == 1:
                p.out[off + cols[:, None] + E2] = vals / total[lane]
            else:
                base = by * p.n_rows * p.q_heads * p.head_dim + off
                p.part_o[base + cols[:, None] + E2] = vals
                if TQ[lane] == 0:
                    m = st.m[half][lane]
                    p.part_ml[base // p.head_dim * 2 : base // p.head_dim * 2 + 2] = (
                        -np.inf if m == -np.inf else m * 0.6931471805599453, total[lane])


# ------------------------------------------------------------------------------------------------
# The kernel (block_attention_pipelined.cuh) and the merge (block_attention.cu).


def pipelined_cta(p: Params, pipe: Pipe, bx, by):
    tile_keys, S, ld, ch = pipe.tile, pipe.stages, pipe.ld, pipe.chunks
    smem = Smem(S * pipe.stage_elems + (0 if pipe.q_in_registers else pipe.rows * ld))
    ring = Ring(S * tile_keys, smem)
    q_s = (S - 1) * pipe.stage_elems if pipe.q_in_registers else S * pipe.stage_elems  # pipelined.cuh:55
    w = cta_work(p, bx, by, pipe.rows, tile_keys)
    if w.begin >= w.end:
        write_empty_partials(p, w, by)
        return
    n_tiles = ceil_div(w.end - w.begin, tile_keys)
    keys = np.arange(tile_keys)  # the threads tid < TILE, one key each

    def slot_of(tile, tid):  # pipelined.cuh:66-69
        k = w.begin + tile * tile_keys + tid
        return key_slot(p, w, k) if k < w.end and k < w.ctx else 0

    def resolve(tile, tid, slot):  # pipelined.cuh:72-79
        k = w.begin + tile * tile_keys + tid
        ring.write(ring_entry(tile, S, tile_keys, tid), rows_of_key(p, w, k, slot) if k < w.end else None)

    def load_tile(tile):  # pipelined.cuh:81-93
        ks = stage_base(tile, pipe)
        vs = ks + tile_keys * ld
        for idx in range(tile_keys * ch):  # every thread's idx = tid, tid + THREADS, ...
            j, c = idx // ch, idx % ch
            kp, vp = ring.read(ring_entry(tile, S, tile_keys, j))
            for dst, ptr in ((ks + j * ld + c * 8, kp), (vs + j * ld + c * 8, vp)):
                vals = np.zeros(8) if ptr is None else p.mem.flat[ptr[0]][ptr[1] + c * 8 : ptr[1] + c * 8 + 8]
                smem.cp_async16(np.array([dst]), vals[None])

    next_slot = [0] * tile_keys  # pipelined.cuh:96-101
    for tid in keys:
        for tile in range(S):
            resolve(tile, tid, slot_of(tile, tid))
        next_slot[tid] = slot_of(S, tid)
    for idx in range(pipe.rows * ch):  # pipelined.cuh:103-107
        r, c = idx // ch, idx % ch
        row = w.row0 + r
        vals = np.zeros(8)
        if row < w.row_end:
            start = p.q + q_offset(p, w, row) + c * 8
            vals = p.mem.flat["q"][start : start + 8]
        smem.cp_async16(np.array([q_s + r * ld + c * 8]), vals[None])
    smem.barrier()
    for tile in range(S - 1):  # pipelined.cuh:110-113
        if tile < n_tiles:
            load_tile(tile)
        smem.commit()

    warps = range(pipe.warps)
    states = [WarpState(p, w, w.row0 + warp * 16, p.head_dim) for warp in warps]
    scale_log2 = p.sm_scale * 1.4426950408889634
    qf = [None] * pipe.warps
    for t in range(n_tiles):  # pipelined.cuh:122-158
        smem.wait(wait_depth(S))
        smem.barrier()
        if pipe.q_in_registers and t == 0:
            for warp in warps:
                qf[warp] = [ldmatrix_x4(smem, q_s + warp * 16 * ld + q_fragment_addr(ld, kk))
                            for kk in range(p.head_dim // 16)]
            smem.barrier()
        if loaded_tile(t, S) < n_tiles:
            load_tile(loaded_tile(t, S))
        smem.commit()
        kb = stage_base(t, pipe)
        for warp in warps:
            if pipe.q_in_registers:
                q_frag = qf[warp].__getitem__
            else:
                q_frag = lambda kk, warp=warp: ldmatrix_x4(smem, q_s + warp * 16 * ld + q_fragment_addr(ld, kk))  # noqa: E731
            s = tile_scores(smem, kb, p.head_dim, tile_keys, ld, q_frag)
            tile_softmax(p, w, w.begin + t * tile_keys, tile_keys, scale_log2, s, states[warp])
            tile_pv(smem, s, kb + tile_keys * ld, p.head_dim, tile_keys, ld, states[warp])
        for tid in keys:
            resolve(prefetched_tile(t, S), tid, next_slot[tid])
            next_slot[tid] = slot_of(prefetched_tile(t, S) + 1, tid)
    smem.wait(0)
    for warp in warps:
        store_rows(p, w, w.row0 + warp * 16, by, states[warp])


def merge_splits(p: Params):  # block_attention.cu, merge_splits_kernel (with online_softmax.h's merge)
    n_pairs = p.n_rows * p.q_heads
    d = p.head_dim
    for pair in range(n_pairs):
        acc = np.zeros(d)
        m, total = -np.inf, 0.0
        for s in range(p.splits):
            part_m, part_sum = p.part_ml[(s * n_pairs + pair) * 2 : (s * n_pairs + pair) * 2 + 2]
            if part_m == -np.inf:
                continue
            new_m = max(m, part_m)
            scale_acc = 0.0 if m == -np.inf else math.exp(m - new_m)
            scale_part = math.exp(part_m - new_m)
            total = total * scale_acc + part_sum * scale_part
            m = new_m
            acc = acc * scale_acc + p.part_o[s * n_pairs * d + pair * d : s * n_pairs * d + (pair + 1) * d] * scale_part
        p.out[pair * d : (pair + 1) * d] = acc / total


def emulate(args, block, window=-1, causal=False, tree_parents=None, *, config=0, policy="work", forced=0, sms=132,
            resident=2):
    pipe = Pipe(args["q"].shape[2], config)
    p, (ctas, splits) = make_params(args, block, window, causal, tree_parents, pipe, policy, forced, sms, resident)
    for by in range(splits):
        for bx in range(ctas):
            pipelined_cta(p, pipe, bx, by)
    if splits > 1:
        merge_splits(p)
    return torch.from_numpy(p.out.reshape(args["q"].shape)), p


# ------------------------------------------------------------------------------------------------
# Tests.


def _random_case(seed):
    rng = np.random.default_rng(seed)
    d = [64, 64, 64, 128, 256][seed % 5]
    group = int(rng.choice([1, 2, 4, 8]))
    hkv = int(rng.integers(1, 3))
    bs = int(rng.integers(1, 4))
    block = int(rng.choice([1, 3, 8, 16]))
    tree = seed % 4 == 3 and block > 1
    ctx = [int(x) for x in rng.integers(0, 150 if d == 64 else 80, bs)]
    window = -1 if tree or rng.random() < 0.5 else int(rng.integers(1, 120))
    causal = not tree and bool(rng.random() < 0.5)
    config = seed % len(PIPE_CONFIGS)
    policy = ["work", "shapes", "forced"][seed % 3]
    return dict(bs=bs, block=block, hq=hkv * group, hkv=hkv, d=d, ctx=ctx, window=window, causal=causal, tree=tree,
                config=config, policy=policy, forced=int(rng.choice([1, 2, 5, 32])), sms=int(rng.integers(1, 40)),
                resident=int(rng.integers(1, 3)), seed=seed)


def _fp32(args):
    """The inputs in fp32 (the same values), so the spec's output is not rounded to bf16."""
    return {k: v.float() if v.is_floating_point() else v for k, v in args.items()}


def _check(case, **overrides):
    args = make_attention_inputs(case["bs"], case["block"], case["hq"], case["hkv"], case["d"], case["ctx"],
                                 torch.bfloat16, seed=case["seed"])
    parents = None
    if case["tree"]:
        parents = make_tree(case["bs"], case["block"], 50, torch.Generator().manual_seed(case["seed"]))[1]
    kwargs = dict(window=case["window"], causal_block=case["causal"], tree_parents=parents)
    out, p = emulate(args, case["block"], case["window"], case["causal"], parents, config=case["config"],
                     policy=case["policy"], forced=case["forced"], sms=case["sms"], resident=case["resident"],
                     **overrides)
    ref = reference.block_attention(**_fp32(args), block_size=case["block"], **kwargs).double()
    assert not p.errors
    err = ((out - ref).abs() / (1 + ref.abs())).amax(dim=-1)  # per (row, head)
    assert torch.isfinite(out).all() and float(err.max()) < 1e-5, (case, float(err.max()))
    return p


@pytest.mark.parametrize("seed", range(20))
def test_emulated_kernel_matches_reference(seed):
    """Random shapes, masks, configurations and split policies: the emulated kernel's output equals
    the spec's, with no shared-memory hazard."""
    _check(_random_case(seed))


@pytest.mark.parametrize("config", range(len(PIPE_CONFIGS)))
@pytest.mark.parametrize("d", [64, 128, 256])
def test_every_configuration_and_head_dim(config, d):
    """Each configuration at each head_dim, over more tiles than stages (the ring and stages wrap),
    with several row tiles when B x group exceeds the CTA's rows, and a forced split count."""
    case = dict(bs=2, block=16, hq=8, hkv=1, d=d, ctx=[3 * 64 * PIPE_CONFIGS[config][1] // (d // 64 or 1), 5],
                window=-1, causal=True, tree=False, config=config, policy="forced", forced=2, sms=1, resident=1,
                seed=config + d)
    _check(case)


def test_split_policies():
    """The work policy gives short requests fewer splits (the rest empty) and long ones more; the
    shape policy splits every request alike; both merge to the spec's output."""
    base = dict(bs=2, block=4, hq=4, hkv=1, d=64, ctx=[700, 300], window=-1, causal=False, tree=False, config=0,
                forced=0, sms=8, resident=2, seed=7)
    work = _check(dict(base, policy="work"))
    # ceil(2 * 8 / 2) CTAs' worth, capped by ceil((703 + 4) / 256): the table is 703 wide
    assert work.splits == 3 and work.split_keys == MIN_KEYS_PER_SPLIT
    ml = work.part_ml.reshape(3, 8, 4, 2)[..., 0]  # [split, q row, q head] max
    assert np.isfinite(ml[:, :4]).all()  # request 0: 704 keys, three splits
    assert np.isfinite(ml[:2, 4:]).all() and np.isinf(ml[2, 4:]).all()  # request 1: 304 keys, two
    shapes = _check(dict(base, policy="shapes"))
    assert shapes.splits == 3 and shapes.split_keys == 0
    assert np.isfinite(shapes.part_ml.reshape(3, 8, 4, 2)[..., 0]).all()  # 304 keys in three slices


def test_an_out_of_range_slot_is_recorded_and_reads_zeros():
    """A slot outside the KV cache: recorded with the kernel's fields (pool row, key, slot, bound), and
    its K / V load as zeros (the output equals the spec's with that key's K and V zero)."""
    args = make_attention_inputs(1, 4, 2, 1, 64, [40], torch.bfloat16, seed=3)
    pool, n_slots = int(args["req_pool_indices"][0]), args["k_cache"].shape[0]
    args["req_to_token"][pool, 17] = n_slots + 5
    out, p = emulate(args, 4)
    assert p.errors == [("kAttentionSlot", pool, 17, n_slots + 5, n_slots)]
    spare = sorted(set(range(n_slots)) - set(args["req_to_token"][pool, :40].tolist()))[0]
    args["k_cache"][spare] = 0
    args["v_cache"][spare] = 0
    args["req_to_token"][pool, 17] = spare
    ref = reference.block_attention(**_fp32(args), block_size=4).double()
    assert float(((out - ref).abs() / (1 + ref.abs())).max()) < 1e-5


def test_fragment_layouts_give_q_k_and_p_v():
    """The ldmatrix / mma address expressions give exactly Q K^T and P V on random tiles (float64)."""
    rng = np.random.default_rng(0)
    for d, tile in [(64, 64), (128, 32), (256, 16)]:
        ld = d + 8
        smem = Smem(16 * ld + 2 * tile * ld)
        qm, km, vm = rng.standard_normal((16, d)), rng.standard_normal((tile, d)), rng.standard_normal((tile, d))
        for base, m in ((0, qm), (16 * ld, km), (16 * ld + tile * ld, vm)):
            for r in range(m.shape[0]):
                smem.val[base + r * ld : base + r * ld + d] = m[r]
        s = tile_scores(smem, 16 * ld, d, tile, ld,
                        lambda kk, ld=ld, smem=smem: ldmatrix_x4(smem, q_fragment_addr(ld, kk)))
        keys = np.stack([score_key(0, nt, e) for nt in range(tile // 8) for e in range(2)])  # [NT*2, 32]
        want = qm @ km.T
        for half in range(2):
            got = np.stack([s[nt, half * 2 + e] for nt in range(tile // 8) for e in range(2)])
            assert np.allclose(got, want[GID + half * 8, keys])
        st = WarpState.__new__(WarpState)
        st.o = np.zeros((d // 8, 4, 32))
        tile_pv(smem, s, 16 * ld + tile * ld, d, tile, ld, st)
        want_o = want @ vm
        for dt in range(d // 8):
            for reg in range(4):
                assert np.allclose(st.o[dt, reg], want_o[GID + (reg // 2) * 8, dt * 8 + 2 * TQ + reg % 2])


# Plausible slips, one per expression: swapped ldmatrix address bits, a key index without the
# factor 2, ring entries or stages that overlap, a copy or a prefetch one tile off, one wait too few.
BROKEN = {
    "k_fragment_addr": lambda ld, kk, n2: (n2 * 16 + ((LANE >> 3) & 1) * 8 + (LANE & 7)) * ld + kk * 16
    + (LANE >> 4) * 8,
    "v_fragment_addr": lambda ld, kk, d2: (kk * 16 + (LANE >> 4) * 8 + (LANE & 7)) * ld + d2 * 16
    + ((LANE >> 3) & 1) * 8,
    "q_fragment_addr": lambda ld, kk: (LANE & 15) * ld + kk * 16 + ((LANE >> 3) & 1) * 8,
    "score_key": lambda k0, nt, e: k0 + nt * 8 + TQ + e,
    "ring_entry": lambda tile, stages, tile_keys, j: (tile % stages) * (tile_keys // 2) + j,
    "stage_base": lambda tile, pipe: (tile % pipe.stages) * (pipe.stage_elems // 2),
    "wait_depth": lambda stages: stages - 1,
    "loaded_tile": lambda t, stages: t + stages,
    "prefetched_tile": lambda t, stages: t + stages - 1,
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_expression_fails(monkeypatch, name):
    """The emulation can fail: each fragment / ring / stage expression, broken, is caught (a wrong
    output or a shared-memory hazard)."""
    case = dict(bs=1, block=8, hq=4, hkv=1, d=64, ctx=[150], window=-1, causal=True, tree=False, config=0,
                policy="forced", forced=1, sms=1, resident=1, seed=1)
    _check(case)
    monkeypatch.setitem(globals(), name, BROKEN[name])
    with pytest.raises(AssertionError):
        _check(case)


def test_configs_match_the_header():
    """PIPE_CONFIGS is block_attention.cuh's kPipeConfigs, and every configuration's shared memory
    fits an H100 / H200 CTA (227 KiB) at every head_dim."""
    text = (ROOT / "csrc" / "cuda" / "block_attention.cuh").read_text()
    body = re.search(r"kPipeConfigs\[\] = \{(.*?)\};", text).group(1)
    assert [tuple(map(int, t)) for t in re.findall(r"\{(\d+), (\d+), (\d+)\}", body)] == PIPE_CONFIGS
    for config in range(len(PIPE_CONFIGS)):
        for d in (64, 128, 256):
            assert Pipe(d, config).smem_bytes <= 227 * 1024, (config, d)


# ------------------------------------------------------------------------------------------------
# verify_block's "fused" variant (csrc/cuda/verify.cu): the one-pass Gumbel-max, the per-warp
# compaction and the radix select, with the kernel's expressions (verify.cu:N at this file's commit).

V_THREADS, V_WARPS, V_CAP = 512, 16, 4096
V_SEGMENT = V_CAP // V_WARPS  # verify.cu:386
MAX_GUMBEL_NOISE = np.float32(16.7)


def float_to_key(x):  # sampling.h
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    return np.where(bits & 0x80000000, ~bits, bits | 0x80000000).astype(np.uint32)


def key_to_float(key):  # sampling.h
    key = np.asarray(key, dtype=np.uint32)
    return np.where(key & 0x80000000, key & 0x7FFFFFFF, ~key).astype(np.uint32).view(np.float32)


def philox_bits(seed, offset, row, vocab):
    """The Philox lane of every vocab id (reference.gumbel_noise's draw, before the logs)."""
    key = (offset + row) & ((1 << 64) - 1)
    group = torch.arange((vocab + 3) // 4, dtype=torch.int64)
    zero = torch.zeros_like(group)
    lanes = reference.philox4x32_10([group, zero, zero + (key & 0xFFFFFFFF), zero + (key >> 32)],
                                    (seed & 0xFFFFFFFF, seed >> 32))
    return torch.stack(lanes, dim=1).reshape(-1)[:vocab].numpy().astype(np.uint32)


def gumbel_upper_bound(bits):  # sampling.h, in fp32
    u = (((bits >> 9) << 1) | 1).astype(np.float32) * np.float32(1.0 / 16777216.0)
    w = np.float32(1.0) - u
    return -np.log(w + np.float32(0.5) * w * w) + np.float32(1e-3)


def gumbel_one_pass(x, noise, bits, rng):
    """verify.cu:335-384 for an aligned fp32 row (a 16-byte vector is one Philox group): thread t
    takes groups t, t + 512, ...; the threads run in a random interleaving, each group reading the
    block's best score as it is at that moment. Returns (winner, exact noises drawn)."""
    vocab = x.size
    n_groups = ceil_div(vocab, 4)
    best_value = np.full(V_THREADS, -np.inf, dtype=np.float32)
    best_index = np.full(V_THREADS, np.iinfo(np.int64).max)
    shared_best = np.float32(-np.inf)
    next_group = np.arange(V_THREADS)
    drawn = 0
    while (next_group < n_groups).any():
        for t in rng.permutation(np.flatnonzero(next_group < n_groups)):
            g = next_group[t]
            next_group[t] += V_THREADS
            ids = np.arange(4 * g, min(4 * g + 4, vocab))
            threshold = max(best_value[t], shared_best)  # verify.cu:342
            if not (x[ids] + MAX_GUMBEL_NOISE >= threshold).any():  # verify.cu:345
                continue
            before = best_value[t]
            for v in ids:
                if x[v] + gumbel_upper_bound(bits[v]) >= threshold:  # verify.cu:352
                    drawn += 1
                    score = np.float32(x[v] + noise[v])
                    if score > best_value[t] or (score == best_value[t] and v < best_index[t]):
                        best_value[t], best_index[t] = score, v
            if best_value[t] > before:
                shared_best = max(shared_best, best_value[t])  # the atomicMax, verify.cu:356
    order = np.lexsort((best_index, -best_value))  # block_best: larger value, then lower index
    winner = int(best_index[order[0]])
    return (0 if winner == np.iinfo(np.int64).max else winner), drawn


@pytest.mark.parametrize("scale,vocab", [(3.0, 20000), (12.0, 9001), (0.5, 4099)])
def test_one_pass_gumbel_matches_reference(scale, vocab):
    """Temperature-only rows: the one-pass search under random thread interleavings picks the spec's
    token, and pruning skips the exact noise of most ids when the row is peaked."""
    rng = np.random.default_rng(vocab)
    for row in range(3):
        logits = torch.from_numpy(rng.standard_normal(vocab).astype(np.float32) * scale)
        temperature, seed, offset = 0.8, 1234, 77
        want = reference.target_samples(logits[None], torch.tensor([temperature]), torch.tensor([0]),
                                        torch.tensor([1.0]), seed, torch.tensor([offset - row]), 1)
        x = (logits.numpy() * np.float32(1 / temperature)).astype(np.float32)  # __fmul_rn(logit, 1 / T)
        noise = reference.gumbel_noise(seed, offset - row, 0, vocab).numpy()
        winner, drawn = gumbel_one_pass(x, noise, philox_bits(seed, offset - row, 0, vocab), rng)
        assert winner == int(want[0, 0])
        if scale >= 12:
            assert drawn < vocab // 4


def compact_by_warps(x, edge):
    """verify.cu:394-425 for an aligned fp32 row: warp w's lanes read vectors c0 + lane for
    c0 = 32 w, 32 w + 512, ...; each of the vector's 4 tokens is one ballot; a token's position is
    the warp's count plus the taken lanes below it. Returns the NaN-padded segments (x, id) and the
    candidates, or -1 when a warp outran its segment."""
    vocab = x.size
    n_vec = vocab // 4
    seg_x = np.full(V_CAP, np.nan, dtype=np.float32)
    seg_id = np.full(V_CAP, -1)
    counts = []
    lanes = np.arange(32)
    for warp in range(V_WARPS):
        count = 0
        base = warp * V_SEGMENT
        steps = [(c0, j) for c0 in range(warp * 32, n_vec, V_THREADS) for j in range(4)]
        steps += [(v0, None) for v0 in range(n_vec * 4 + warp * 32, vocab, V_THREADS)]  # the scalar tail
        for c0, j in steps:
            v = (c0 + lanes) * 4 + j if j is not None else c0 + lanes
            valid = (c0 + lanes < n_vec) if j is not None else v < vocab
            take = valid & (x[np.minimum(v, vocab - 1)] >= edge)
            pos = count + np.array([int(take[:lane].sum()) for lane in lanes])  # popc(taken & lower)
            keep = take & (pos < V_SEGMENT)
            seg_x[base + pos[keep]] = x[v[keep]]
            seg_id[base + pos[keep]] = v[keep]
            count += int(take.sum())
        counts.append(count)
    return seg_x, seg_id, (-1 if max(counts) > V_SEGMENT else sum(counts))


@pytest.mark.parametrize("vocab,edge", [(20001, 2.0), (151936, 2.9), (5003, -np.inf), (20000, 1.2)])
def test_warp_compaction_keeps_exactly_the_tokens_above_the_edge(vocab, edge):
    x = np.random.default_rng(vocab).standard_normal(vocab).astype(np.float32)
    x[::97] = np.nan  # NaN never enters
    seg_x, seg_id, n = compact_by_warps(x, np.float32(edge))
    wanted = np.flatnonzero(x >= edge)
    if len(wanted) > V_CAP // 2 and n < 0:
        return  # a warp outran its segment: the caller searches the whole row instead
    assert n == len(wanted)
    kept = seg_id[seg_id >= 0]
    assert sorted(kept.tolist()) == wanted.tolist() and np.array_equal(seg_x[seg_id >= 0], x[kept])
    assert np.isnan(seg_x[seg_id < 0]).all()
    for warp in range(V_WARPS):  # each segment in its warp's reading order: vector, then lane-chunk order
        ids = seg_id[warp * V_SEGMENT : (warp + 1) * V_SEGMENT]
        ids = ids[ids >= 0]
        assert all(((ids // 4) // 32 % V_WARPS == warp) | (ids >= vocab // 4 * 4))


def test_warp_compaction_reports_an_overflow():
    """384 candidates, few for the block, all in vectors warp 0 reads (0-31, 512-543, 1024-1055):
    more than its segment holds, reported as -1; spread over the warps, the same count fits."""
    x = np.zeros(40000, dtype=np.float32)
    vectors = (np.arange(3)[:, None] * V_THREADS + np.arange(32)[None]).reshape(-1)
    x[(vectors[:, None] * 4 + np.arange(4)[None]).reshape(-1)] = 5.0
    assert compact_by_warps(x, np.float32(4.0))[2] == -1
    x[:] = 0.0
    x[:384] = 5.0  # vectors 0-95: warps 0, 1 and 2, 128 each
    assert compact_by_warps(x, np.float32(4.0))[2] == 384


def kth_largest_radix(values, k):
    """verify.cu:433-472 over the set's non-NaN entries."""
    keys = float_to_key(values[~np.isnan(values)])
    prefix, known = 0, 0
    for level in range(3):
        shift = (20, 8, 0)[level]  # verify.cu:436
        bins = 256 if level == 2 else 4096
        match = keys[(keys & known) == prefix]  # verify.cu:442
        hist = np.bincount((match >> shift) & (bins - 1), minlength=bins)
        above = np.concatenate([np.cumsum(hist[::-1])[::-1][1:], [0]])  # entries in higher bins
        (found,) = np.flatnonzero((above < k) & (above + hist >= k))  # verify.cu:458, one bin
        prefix |= int(found) << shift
        known |= (bins - 1) << shift
        k -= int(above[found])  # verify.cu:467
    t = key_to_float(np.uint32(prefix))
    return np.float32(0.0) if t == 0 else t  # verify.cu:471


def kth_largest_bisection(values, k):
    """The CPU twin's kth_largest (csrc/cpu/verify.cpp): the largest key t in [key(-inf), key(max)]
    with count(x >= t) >= k."""
    v = values[~np.isnan(values)]
    lo, hi = int(float_to_key(np.float32(-np.inf))), int(float_to_key(v.max()))
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        if int((v >= key_to_float(np.uint32(mid))).sum()) >= k:
            lo = mid
        else:
            hi = mid - 1
    return key_to_float(np.uint32(lo))


@pytest.mark.parametrize("seed", range(6))
def test_radix_select_returns_the_bisections_threshold(seed):
    """Bit for bit the CPU twin's top-k threshold, ties, -0 / +0, -inf and NaN padding included."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3000))
    values = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
    if seed % 2:
        values = np.round(values)  # many ties, and -0 beside +0
        values[rng.random(n) < 0.1] = np.float32(-0.0)
        values[rng.random(n) < 0.05] = -np.inf
    padded = np.concatenate([values, np.full(int(rng.integers(0, 50)), np.nan, dtype=np.float32)])
    rng.shuffle(padded)
    for k in sorted({1, 2, n // 3 + 1, n // 2 + 1, n} | set(rng.integers(1, n + 1, 5).tolist())):
        got, want = kth_largest_radix(padded, k), kth_largest_bisection(padded, k)
        assert got.tobytes() == want.tobytes(), (k, got, want)
