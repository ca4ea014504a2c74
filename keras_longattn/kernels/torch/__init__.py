"""PyTorch entries of the backend table (see :mod:`keras_longattn.kernels`).

Measured on a CPU with torch 2.13: ``index_select`` / ``index_add`` have
gradients several times cheaper than the embedding lookup and scatter that
``keras.ops.take`` / ``keras.ops.segment_sum`` run; ``topk`` over a
non-last axis avoids a transposed copy; the fused
``scaled_dot_product_attention`` makes the ``"fused"`` implementations
faster than explicit einsums, so ``"auto"`` prefers them.
"""

import torch
from keras import ops

from keras_longattn.kernels import BackendOps

#: Most scores (elements of one ``(chunks, w, 2w)`` mask) that one attention
#: call of sorted-chunk attention takes. Keeping every temporary of a call
#: well under glibc's largest mmap threshold (32 MiB) lets the allocator
#: reuse memory between calls instead of mapping and page-faulting fresh
#: buffers, which cost more than the attention itself at n = 16K on a CPU.
MAX_SCORES_PER_CALL = 1 << 22


class TorchOps(BackendOps):
    name = "torch"

    @property
    def auto_preference(self):
        """Fused kernels first (the CPU flash kernel and the band kernels);
        FlexAttention before them on a GPU of a vendor for which a device
        run proved it on its current sources
        (:mod:`keras_longattn.kernels.proven`)."""
        from keras_longattn.kernels import proven

        if "flex" in proven.trusted_kinds("torch", proven.active_vendor("torch")):
            return ("flex", "fused", "explicit")
        return ("fused", "explicit")
    max_scores_per_call = MAX_SCORES_PER_CALL

    @property
    def kernelized(self):
        # Written-out backward passes for LinearAttention and
        # PerformerAttention (kernels/torch/kernelized.py).
        from keras_longattn.kernels.torch import kernelized

        return kernelized

    @property
    def routing(self):
        # RoutingAttention "routed_torch" (kernels/torch/routing.py).
        from keras_longattn.kernels.torch import routing

        return routing

    @property
    def lsh(self):
        # LSHAttention "hashed_torch" (kernels/torch/lsh.py).
        from keras_longattn.kernels.torch import lsh

        return lsh

    @property
    def flex(self):
        # The "flex" paths: FlexAttention under the layers' patterns
        # (kernels/torch/flex.py; its refusal says when torch has none).
        from keras_longattn.kernels.torch import flex

        return flex

    def take_rows(self, x, rows):
        x = ops.convert_to_tensor(x)
        rows = ops.convert_to_tensor(rows).to(torch.int64)
        return torch.index_select(x, 0, rows)

    def segment_sum(self, data, segment_ids, num_segments):
        data = ops.convert_to_tensor(data)
        ids = ops.convert_to_tensor(segment_ids).to(torch.int64)
        out = torch.zeros(
            (int(num_segments),) + tuple(data.shape[1:]),
            dtype=data.dtype,
            device=data.device,
        )
        return out.index_add(0, ids, data)

    def cluster_sums(self, x, assignment, num_clusters):
        # The token rows summed into H * (k + 1) segments (the last of each
        # head: padding) by segment_sum's index_add: O(n d), no (B, H, n, k)
        # indicator. Measured (n = 16384, H = 4, d = 64, k = 128, 2 threads):
        # 3.5 ms against 25 ms for the indicators' product, whose 32 MiB
        # float tensor is mapped and page-faulted afresh on every call.
        x = ops.convert_to_tensor(x).to(torch.float32)
        a = ops.convert_to_tensor(assignment).to(torch.int64)
        B, n, H, d = x.shape
        k = int(num_clusters)
        rows = (torch.arange(H, device=a.device).view(1, H, 1) * (k + 1) + a).reshape(-1)
        tokens = x.permute(0, 2, 1, 3).reshape(-1, d)  # (B * H * n, d), as ``rows``
        sums = self.segment_sum(tokens, rows, H * (k + 1))
        counts = torch.bincount(rows, minlength=H * (k + 1)).to(torch.float32)
        return sums.view(H, k + 1, d)[:, :k], counts.view(H, k + 1)[:, :k]

    def top_k_indices(self, x, k, axis=-1):
        x = ops.convert_to_tensor(x)
        k = int(k)
        idx = torch.topk(x, k, dim=axis, sorted=False).indices
        # torch.topk resolves ties at the k-th value in no stated order.
        # Where a row has more entries equal to its k-th value than places
        # left, take them by ascending position (as JAX and TensorFlow do).
        kth = torch.amin(torch.gather(x, axis, idx), dim=axis, keepdim=True)
        # An int32 sum: count_nonzero (and an int64 sum) cast the whole
        # boolean to int64 first (64 MiB at (1, 4, 16384, 128), page-faulted
        # per call): 33-37 ms against 17-18 ms measured.
        at_least = (x >= kth).sum(dim=axis, dtype=torch.int32)
        if bool((at_least > k).any()):
            above = x > kth
            need = k - above.sum(dim=axis, dtype=torch.int32).unsqueeze(axis)
            tie = x == kth
            rank = torch.cumsum(tie.to(torch.int32), dim=axis)
            chosen = above | (tie & (rank <= need))
            # Exactly k chosen per row: their positions, ascending.
            moved = chosen.movedim(axis, -1)
            pos = moved.nonzero()[:, -1].reshape(moved.shape[:-1] + (k,))
            idx = pos.movedim(-1, axis)
        return idx.to(torch.int32)

    def kept_items(self, flags):
        if torch.compiler.is_compiling():
            return None
        return ops.convert_to_tensor(flags).nonzero()[:, 0]

    def compile(self, fn, static_argnames=()):
        # Kernels stay eager inside a model compiled by Keras
        # (jit_compile=True): TorchInductor 2.13 emits C++ that does not
        # compile for some of them, and some use data-dependent shapes.
        # Eager calls run the function directly (no wrapper cost).
        disabled = torch.compiler.disable(fn)

        def run(*args, **kwargs):
            if torch.compiler.is_compiling():
                return disabled(*args, **kwargs)
            return fn(*args, **kwargs)

        return run

    # Sliding-window attention on the CPU flash kernel (kernels/torch/band.py).
    def band_attention_refusal(self, dtype, query_length, key_length, key_dim, value_dim):
        from keras_longattn.kernels.torch import band

        return band.refusal(dtype, query_length, key_length, key_dim, value_dim)

    def band_kernel_variant(self):
        from keras_longattn.kernels.torch import native

        return None if native.band_ops() is not None else "flash"

    def band_attention(self, q, k, v, look_back, look_ahead, block_size=None,
                       key_mask=None, scale=None, extra_keys=None, extra_values=None,
                       extra_mask=None):
        from keras_longattn.kernels.torch import band

        return band.band_attention_eager(
            q, k, v, look_back, look_ahead, block_size=block_size,
            key_mask=key_mask, scale=scale, extra_keys=extra_keys,
            extra_values=extra_values, extra_mask=extra_mask,
        )

    def strided_attention(self, q, k, v, stride, causal, window_heads, scale):
        from keras_longattn.kernels.torch import strided

        return strided.strided_attention_eager(q, k, v, stride, causal, window_heads, scale)

    def fixed_attention(self, q, k, v, block_length, summary_width, causal, block_heads,
                        scale):
        from keras_longattn.kernels.torch import fixed

        return fixed.fixed_attention_eager(q, k, v, block_length, summary_width, causal,
                                           block_heads, scale)


OPS = TorchOps()
