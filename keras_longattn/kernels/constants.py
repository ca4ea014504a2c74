"""Constants and argument checks shared by the kernels and
:mod:`keras_longattn.ops`.

They live here, beside the kernels, so that a kernel module needs nothing
from :mod:`keras_longattn.ops` (which re-exports them where its own
functions document them).
"""

from keras_longattn._validation import positive_finite_float
from keras_longattn._validation import positive_int

#: Logit given to masked entries before the softmax, and the log-sum-exp of
#: a row with no visible key. Finite, so that such a row stays finite; its
#: output is zeroed afterwards.
MASKED_LOGIT = -1e30

#: Smallest normaliser a query of kernelized attention is divided by.
DEFAULT_EPSILON = 1e-6

#: Positions per chunk of causal kernelized attention (about
#: ``sqrt(F * dv)`` for heads of 64 balances its two terms of memory).
DEFAULT_CHUNK_SIZE = 64


def check_chunk_size(chunk_size):
    """``chunk_size`` as an int >= 1, else a ValueError naming it."""
    return positive_int("chunk_size", chunk_size)


def check_epsilon(epsilon):
    """``epsilon`` as a finite float > 0, else a ValueError naming it (an
    infinite ``epsilon`` would divide every output to zero, a NaN would
    make every output NaN)."""
    return positive_finite_float("epsilon", epsilon)
