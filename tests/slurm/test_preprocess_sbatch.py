"""slurm/preprocess.sbatch as a job array: per-task parts merged into one verified dataset,
identical (shard for shard) to a single preprocess run over the whole corpus."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.slurm.cluster import REPO, cancel, poll, sbatch, wait_job

pytestmark = pytest.mark.multiprocess  # every test here starts processes

TIMEOUT = 180


@pytest.fixture
def jobs(slurm):
    ids: list[str] = []
    yield ids
    cancel(ids, slurm)


def test_array_job_makes_one_verified_dataset(slurm, jobs, tiny_dataset, tmp_path):
    out = tmp_path / "data"
    # 3 tasks for 8 languages: tasks take 3, 3 and 2 languages.
    array = sbatch(["--array=0-2", "--cpus-per-task=1", f"--output={tmp_path}/pre-%A_%a.out",
                    "slurm/preprocess.sbatch", str(tiny_dataset["corpus"]),
                    str(tiny_dataset["tokenizer"]), str(out), "--seq-length", "32"], slurm)
    jobs.append(array)
    first_log = tmp_path / f"pre-{array}_0.out"
    merge = poll(lambda: first_log.exists()
                 and re.search(r"submitted merge job (\d+)", first_log.read_text()),
                 TIMEOUT, "task 0 to submit the merge job").group(1)
    jobs.append(merge)
    for task in range(3):
        wait_job(f"{array}_{task}", slurm, TIMEOUT, tmp_path / f"pre-{array}_{task}.out")
    merge_log = tmp_path / f"rembert-preprocess-merge-{merge}.out"
    wait_job(merge, slurm, TIMEOUT, merge_log)
    assert "verify: 0 problem(s)" in merge_log.read_text()

    # The dataset tool accepts it, independently of the job's own check.
    check = subprocess.run([sys.executable, "data_tools/inspect_shards.py", str(out), "--verify",
                            "--tokenizer", str(tiny_dataset["tokenizer"])],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr

    merged = json.loads((out / "manifest.json").read_text())
    single = json.loads((tiny_dataset["data"] / "manifest.json").read_text())
    assert sorted(merged["languages"]) == sorted(single["languages"])
    assert merged["languages"] == single["languages"]
    assert merged["shards"] == single["shards"]  # same files, rows, tokens and sha256
    assert merged["tokenizer"] == single["tokenizer"]
