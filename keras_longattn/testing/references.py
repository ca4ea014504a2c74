"""Plain NumPy references of the ops, written for clarity, not speed."""

import numpy as np


def sorted_chunk_mask_loop(cq, ck, k, w, shared):
    """Sorted-chunk attention's mask by brute force, a plain NumPy loop: per
    bucket, members in position order (a key before the query of its
    position), chunks of ``w`` members; a query sees the keys of its own and
    the previous chunk that are not after it.

    Args:
        cq, ck: int arrays ``(T,)`` / ``(S,)`` of query and key buckets.
        k: number of buckets (value ``k`` marks padding).
        w: chunk size.
        shared: queries and keys are the same tokens.

    Returns:
        boolean ``(T, S)``.
    """
    T, S = len(cq), len(ck)
    mask = np.zeros((T, S), bool)
    for c in range(k):
        if shared:
            items = [(t, "qk") for t in range(T) if cq[t] == c]
        else:
            items = [(j, "k") for j in range(S) if ck[j] == c]
            items += [(t, "q") for t in range(T) if cq[t] == c]
            items.sort(key=lambda it: (it[0], it[1] == "q"))
        chunk = {}
        for r, it in enumerate(items):
            chunk[it] = r // w
        for qi_ in items:
            if "q" not in qi_[1]:
                continue
            for ki_ in items:
                if "k" not in ki_[1]:
                    continue
                if ki_[0] <= qi_[0] and chunk[qi_] - 1 <= chunk[ki_] <= chunk[qi_]:
                    mask[qi_[0], ki_[0]] = True
    return mask
