from __future__ import annotations

from daskpipe.plan.specs import PACKAGE_DATA, REPO_PLANS, clusters, groups


def test_package_copies_match_plans_folder():
    for name in ("clusters.json", "groups.json"):
        assert (PACKAGE_DATA / name).read_text() == (REPO_PLANS / name).read_text(), f"daskpipe/data/{name} differs from plans/{name}"


def test_paper_clusters_and_groups():
    hc = clusters()
    assert dict(hc["HC3"].gpus) == {"V100": 25, "P4": 75} and hc["HC3"].bw_gbps == 6
    assert dict(hc["HC4"].gpus_per_server) == {"V100": 4, "T4": 2}
    assert all(sum(hc[n].gpus.values()) == 100 for n in ("HC1", "HC2", "HC3", "HC4"))
    g = groups()
    assert g["G4"].models == ("fcn", "gfl_x101", "wide_resnet101_2") and g["G4"].weights == (0.30, 0.33, 0.37)
