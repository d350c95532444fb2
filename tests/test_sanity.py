"""The replica check's decision: identical tensors match exactly, any difference names itself."""

import torch

from distrain.parallel.sanity import fingerprints, mismatches


def test_identical_replicas_pass_and_a_drift_is_named():
    weight = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(8, generator=torch.Generator().manual_seed(1))
    drifted = weight.clone()
    drifted[3, 5] = torch.nextafter(drifted[3, 5], torch.tensor(10.0))  # one ulp
    replicas = torch.stack(
        [
            torch.stack([fingerprints(weight), fingerprints(bias)]),
            torch.stack([fingerprints(weight.clone()), fingerprints(bias.clone())]),
            torch.stack([fingerprints(drifted), fingerprints(bias)]),
        ]
    )
    found = mismatches(["w", "b"], replicas, ranks=[0, 2, 4])
    assert found == ["w differs across data-parallel replicas: ranks [0, 2] vs [4]"]
    assert mismatches(["w", "b"], replicas[:2], ranks=[0, 2]) == []


def test_permuted_values_are_told_apart():
    values = torch.arange(16, dtype=torch.float32)
    swapped = values.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert not torch.equal(fingerprints(values), fingerprints(swapped))
