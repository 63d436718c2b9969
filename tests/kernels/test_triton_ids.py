"""The one-launch device token-id guard (``kernels/ids.py``) against its torch-op oracle
(``DeviceIdGuard.guard_reference``): random padded layouts with out-of-vocabulary ids (negative,
past the vocabulary, in padding rows, several in one request), empty padded requests and
requests longer than one block. Runs under the interpreter on the CPU and as is on a GPU."""

from __future__ import annotations

import random

import pytest
import torch

from dspark_compile.kernels.ids import BLOCK, ids_guard_triton
from dspark_compile.session.ids import DeviceIdGuard

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 50


def _layout(rng: random.Random, reqs: int, pad_reqs: int, pad_rows: int, max_len: int,
            slots_total: int):
    lens = [rng.randint(1, max_len) for _ in range(reqs)]
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    qsl += [qsl[-1]] * pad_reqs  # empty padded requests, as a tier pads them
    slots = rng.sample(range(slots_total), reqs) + [0] * pad_reqs
    n = qsl[-1] + pad_rows
    ids = [rng.randrange(VOCAB) for _ in range(n)]
    for _ in range(rng.randint(0, 4)):  # bad ids anywhere, padding rows included
        ids[rng.randrange(n)] = rng.choice([-1, -7, VOCAB, VOCAB + 3, 2 ** 40])
    return (torch.tensor(ids, device=DEVICE), torch.tensor(qsl, dtype=torch.int32,
                                                              device=DEVICE),
            torch.tensor(slots, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("seed", range(12))
def test_guard_kernel_equals_the_torch_ops(seed):
    rng = random.Random(seed)
    slots_total = 9
    ids, qsl, slots = _layout(rng, rng.randint(1, 6), rng.randint(0, 2), rng.randint(0, 3),
                              rng.choice([3, 8, BLOCK + 5]), slots_total)
    want_guard, got_guard = (DeviceIdGuard(slots_total, torch.device(DEVICE)) for _ in range(2))
    for g in (want_guard, got_guard):  # stale flags from an earlier step must be overwritten
        g.flags.fill_(7)
    want = want_guard.guard_reference(ids, qsl, slots, VOCAB)
    got = ids_guard_triton(ids, qsl, slots, got_guard.flags, VOCAB)
    assert torch.equal(got, want)
    live = slots[:int((qsl[1:] > qsl[:-1]).sum())].long()  # the slots of non-empty requests
    assert torch.equal(got_guard.flags[:, live], want_guard.flags[:, live])
    untouched = torch.ones(slots_total + 1, dtype=torch.bool, device=DEVICE)
    untouched[live] = False
    assert (got_guard.flags[:, untouched] == 7).all(), "a slot with no request keeps its flag"


def test_the_first_bad_row_of_a_request_and_its_id_are_recorded():
    ids = torch.tensor([3, VOCAB + 1, -2, 4, 5, 6, 2 ** 40], device=DEVICE)
    qsl = torch.tensor([0, 3, 6], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([4, 1], dtype=torch.int32, device=DEVICE)
    guard = DeviceIdGuard(6, torch.device(DEVICE))
    out = ids_guard_triton(ids, qsl, slots, guard.flags, VOCAB)
    assert out.tolist() == [3, VOCAB - 1, 0, 4, 5, 6, VOCAB - 1]  # padding row clamped too
    assert guard.rows.tolist()[4] == 2 and guard.tokens.tolist()[4] == VOCAB + 1
    assert guard.rows.tolist()[1] == 0 and guard.tokens.tolist()[1] == 0
