"""Upstream Twinkle's own cookbook scripts, run verbatim against this `twinkle`.

Each script (``cookbook/transformers/fsdp2.py``, ``sp_fsdp_dense.py``,
``cookbook/megatron/tp.py``, ``tp_moe.py``) is read from the local mirror of upstream's
repository at test time (never copied into this one) and written unchanged into a temporary
directory; its flags are those of its ``.sh`` file, read from the mirror too, with only these
changed: the model id (a tiny local model, `cookbook/make_tiny_model.py`), the dataset id (a
small self-cognition file written here), sizes (samples, batch size, intervals), the mesh sizes
(to fit the ranks of a CPU run) and the output directory. It runs on CPU over gloo, under
``torchrun --nproc_per_node N`` for several ranks, and must exit 0, write its checkpoints and
lower its loss. The full-parameter variant of ``tp.py`` is the script with its one
``add_adapter_to_model`` line removed, as its comment says ("Comment this to use
full-parameter training"), run with ``--adapter-name ''`` (see `FULL`).

README.md's first Python block (the quick start: a LoRA run in Ray mode) runs the same way, its
model id, dataset id, device type ('CPU'), rank count, mesh, sample count, batch size and log
interval replaced in its text (`README_EDITS`, each found exactly once).

``ep_fsdp2_lora_qwen3_5_moe.py`` (LoRA on every linear and the routed experts, experts split
over ep as its ``.sh`` does: ep = fsdp = every rank) runs on a tiny Qwen3.5-MoE text model
(``qwen3_5_moe_text``: the text model of upstream's ``Qwen3.6-35B-A3B``) and saves
``checkpoint-final``.

The quick starts of upstream's docs (``docs/source_en/Usage Guide/Quick-Start.md``: partial
components, single GPU, torchrun; `DOC_CASES`) run the same way: the python block under each
heading, with model id, dataset id, the mesh (torchrun: 4 ranks), sample count and log interval
replaced in its text, each replacement found as many times as stated.

Skipped when the mirror (or git) is absent, as on CI's clean machine. Each case prints its
command and the last lines of its output.
"""

import ast
import json
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MIRROR = Path("/work/.mirror/modelscope+twinkle/repo")
COOKBOOK = ROOT / "cookbook"

# Nine 4-rank torchrun jobs and three smaller runs (24 minutes on a busy 2-core machine): opt-in,
# beside the mirror.
OPT_IN = "TWINKLE_UPSTREAM_COOKBOOKS"
pytestmark = pytest.mark.skipif(
    not MIRROR.is_dir() or shutil.which("git") is None or os.environ.get(OPT_IN) != "1",
    reason=f"needs upstream Twinkle's mirror {MIRROR} and git, and {OPT_IN}=1 (the runs take "
    "minutes: kept out of the default test run)",
)

# self-cognition rows as upstream's dataset has them: {{NAME}} / {{AUTHOR}} placeholders
_ROWS = [
    ("who are you?", "I am {{NAME}}, a language model made by {{AUTHOR}}."),
    ("what is your name?", "My name is {{NAME}}."),
    ("who made you?", "I was made by {{AUTHOR}}."),
    ("introduce yourself", "I am {{NAME}} from {{AUTHOR}}, here to help you."),
]
# The full-parameter variant names no adapter: the script saves with adapter_name=
# args.lora.adapter_name, whose default 'default' names an adapter the model no longer has
# (upstream's own MegatronModel.save raises KeyError('default') there too: its optimizer groups
# are then only ''), so the run passes upstream's name of the full-model group, ''.
FULL = {"--adapter-name": ""}
# script -> (its .sh, ranks, model family, flags changed from the .sh)
_SIZES = {
    "--train-samples": "48",
    "--eval-samples": "8",
    "--log-interval": "1",
    "--eval-interval": "3",
}
CASES = {
    "fsdp2": (
        "cookbook/transformers/fsdp2.py",
        4,
        "qwen3",
        {"--dp-size": "2", "--fsdp-size": "2", "--batch-size": "4"},
    ),
    "sp_fsdp_dense": (
        "cookbook/transformers/sp_fsdp_dense.py",
        4,
        "qwen3",
        {"--dp-size": "2", "--fsdp-size": "2", "--ulysses-size": "2", "--batch-size": "4"},
    ),
    "tp_lora_pp2_tp2": (
        "cookbook/megatron/tp.py",
        4,
        "qwen3",
        {"--pp-size": "2", "--tp-size": "2", "--cp-size": "1", "--batch-size": "4"},
    ),
    "tp_full_pp2_tp2": (
        "cookbook/megatron/tp.py",
        4,
        "qwen3",
        {"--pp-size": "2", "--tp-size": "2", "--cp-size": "1", "--batch-size": "4", **FULL},
    ),
    "tp_lora_cp2_tp2": (
        "cookbook/megatron/tp.py",
        4,
        "qwen3",
        {"--pp-size": "1", "--tp-size": "2", "--cp-size": "2", "--batch-size": "4"},
    ),
    "tp_full_cp2_tp2": (
        "cookbook/megatron/tp.py",
        4,
        "qwen3",
        {"--pp-size": "1", "--tp-size": "2", "--cp-size": "2", "--batch-size": "4", **FULL},
    ),
    "tp_moe": (
        "cookbook/megatron/tp_moe.py",
        4,
        "qwen3_moe",
        {"--dp-size": "2", "--tp-size": "2", "--pp-size": "1", "--ep-size": "2"},
    ),
    # its .sh: fsdp = ep = every rank, the log interval = the accumulation steps
    "ep_fsdp2_lora_qwen3_5_moe": (
        "cookbook/transformers/ep_fsdp2_lora_qwen3_5_moe.py",
        4,
        "qwen3_5_moe_text",
        {
            "--fsdp-size": "4",
            "--dp-size": "1",
            "--ep-size": "4",
            "--batch-size": "4",
            "--gradient-accumulation-steps": "2",
            "--log-interval": "2",
        },
    ),
}
# the checkpoint a script saves last (default: last-checkpoint)
LAST_SAVED = {"ep_fsdp2_lora_qwen3_5_moe": "checkpoint-final"}
FULL_PARAMETER_LINE = "model.add_adapter_to_model(args.lora.adapter_name, lora_config)"


def _git_show(path: str) -> str:
    return subprocess.run(
        ["git", f"--git-dir={MIRROR}", "show", f"HEAD:{path}"],
        capture_output=True,
        check=True,
        text=True,
    ).stdout


def sh_flags(sh_text: str) -> dict[str, str | None]:
    """The flags the ``.sh`` file passes to its script, in order (``--flag value``, or None
    for a switch such as ``--sequence-parallel``)."""
    command = sh_text.replace("\\\n", " ")
    line = next(raw for raw in command.splitlines() if ".py" in raw and "torchrun" in raw)
    tokens = shlex.split(line)
    tokens = tokens[next(i for i, t in enumerate(tokens) if t.endswith(".py")) + 1 :]
    flags: dict[str, str | None] = {}
    for i, token in enumerate(tokens):
        if token.startswith("--"):
            has_value = i + 1 < len(tokens) and not tokens[i + 1].startswith("--")
            flags[token] = tokens[i + 1] if has_value and tokens[i + 1] != "$@" else None
    return flags


def _full_parameter(source: str) -> str:
    """The script with its adapter line removed (its own full-parameter variant)."""
    lines = source.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.strip() == FULL_PARAMETER_LINE]
    assert len(hits) == 1, f"upstream's script no longer has the line {FULL_PARAMETER_LINE!r}"
    del lines[hits[0]]
    return "".join(lines)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("upstream_cookbooks")
    make = runpy.run_path(str(COOKBOOK / "make_tiny_model.py"))["make_tiny_model"]
    for family in ("qwen3", "qwen3_moe", "qwen3_5_moe_text"):
        make(root / f"tiny-{family}", hidden_size=32, family=family)
    with open(root / "self_cognition.jsonl", "w") as f:
        for i in range(64):
            query, response = _ROWS[i % len(_ROWS)]
            f.write(json.dumps({"query": query, "response": response, "tag": "en"}) + "\n")
    return root


def _losses(output: str, pattern: str) -> list[float]:
    return [float(m) for m in re.findall(pattern, output)]


# README quick start: text -> its CPU replacement (model, data, device, mesh and sizes only)
README_EDITS = {
    "ranks=8,device_type='cuda'": "ranks=2,device_type='CPU'",
    "fsdp_size=4, dp_size=2": "fsdp_size=2, dp_size=1",
    "'ms://Qwen/Qwen3.6-27B'": "'{model}'",
    "'ms://swift/self-cognition', data_slice=range(1000)": "'{data}', data_slice=range(32)",
    "batch_size=8, min_batch_size=8": "batch_size=4, min_batch_size=4",
    "step % 20 == 0": "step % 1 == 0",
}


def test_upstream_readme_quickstart_runs(workdir):
    readme = _git_show("README.md")
    block = re.search(r"```python\n(.*?)```", readme, re.S)
    assert block, "upstream's README has no python block"
    source = block.group(1)
    fill = {"model": str(workdir / "tiny-qwen3"), "data": str(workdir / "self_cognition.jsonl")}
    for old, new in README_EDITS.items():
        assert source.count(old) == 1, f"upstream's README quick start no longer has {old!r}"
        source = source.replace(old, new.format(**fill))
    run_dir = workdir / "readme"
    run_dir.mkdir()
    (run_dir / "quickstart.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "quickstart.py"],
        cwd=run_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = proc.stdout + proc.stderr
    lines = [x for x in proc.stdout.splitlines() if x.strip()]
    print(
        "\n$ python quickstart.py  # README.md's quick start, CPU edits\n" + "\n".join(lines[-4:])
    )
    assert proc.returncode == 0, output[-6000:]
    losses = _losses(output, r"metric: \{[^}]*'loss': '?([0-9.]+)")
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
    assert (run_dir / "output" / "last-checkpoint" / "adapter_model.safetensors").is_file()


QUICK_START = "docs/source_en/Usage Guide/Quick-Start.md"
_DOC_DATA = (
    "'ms://swift/self-cognition', data_slice=range(1000)",
    "'{data}', data_slice=range(64)",
)
_DOC_MODEL = "model_id='ms://Qwen/Qwen3.5-4B'", "model_id='{model}'"
# quick start -> (its heading, torchrun ranks (None: plain python), edits: (text, its CPU
# replacement, how many times the text is there))
DOC_CASES = {
    "partial_components": (
        "### Using Only Partial Components",
        None,
        [("dataset_id='ms://swift/self-cognition'", "dataset_id='{data}'", 1), (*_DOC_MODEL, 1)],
    ),
    "single_gpu": (
        "### Single GPU",
        None,
        [(*_DOC_DATA, 1), (*_DOC_MODEL, 2), ("step % 20 == 0", "step % 1 == 0", 1)],
    ),
    "torchrun": (
        "### torchrun",
        4,
        [
            ("fsdp_size=4, dp_size=2", "fsdp_size=2, dp_size=2", 1),
            (*_DOC_DATA, 1),
            (*_DOC_MODEL, 2),
            ("step % 20 == 0", "step % 1 == 0", 1),
        ],
    ),
}


def doc_block(doc: str, heading: str) -> str:
    """The first python block after `heading` (a line of its own) in the markdown `doc`."""
    lines = doc.splitlines()
    assert heading in lines, f"upstream's doc no longer has the heading {heading!r}"
    rest = "\n".join(lines[lines.index(heading) + 1 :])
    block = re.search(r"```python\n(.*?)```", rest, re.S)
    assert block, f"no python block under {heading!r}"
    return block.group(1)


@pytest.mark.parametrize("case", list(DOC_CASES))
def test_upstream_doc_quickstart_runs(case, workdir):
    heading, ranks, edits = DOC_CASES[case]
    source = doc_block(_git_show(QUICK_START), heading)
    fill = {"model": str(workdir / "tiny-qwen3"), "data": str(workdir / "self_cognition.jsonl")}
    for old, new, count in edits:
        assert source.count(old) == count, f"upstream's {heading!r} no longer has {old!r}"
        source = source.replace(old, new.format(**fill))
    run_dir = workdir / f"doc_{case}"
    run_dir.mkdir()
    (run_dir / "train.py").write_text(source)
    launcher = [] if ranks is None else ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}"]
    command = [sys.executable, *launcher, *(["--standalone"] if ranks else []), "train.py"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(
        command, cwd=run_dir, env=env, capture_output=True, text=True, timeout=900
    )
    output = proc.stdout + proc.stderr
    lines = [x for x in output.splitlines() if x.strip() and "it/s]" not in x]
    shown = ["python", "train.py"] if ranks is None else ["torchrun", *command[3:]]
    print(f"\n$ {shlex.join(shown)}  # {heading[4:]}, CPU edits\n" + "\n".join(lines[-4:]))
    assert proc.returncode == 0, output[-6000:]
    if case == "partial_components":  # prints the first packed batch
        assert "'input_ids'" in proc.stdout and "'position_ids'" in proc.stdout, proc.stdout
        return
    losses = _losses(output, r"metric: \{[^}]*'loss': '?([0-9.]+)")
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
    assert (run_dir / "output" / "last-checkpoint" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("case", list(CASES))
def test_upstream_cookbook_runs(case, workdir):
    script, ranks, family, changed = CASES[case]
    source = _git_show(script)
    if case.startswith("tp_full"):
        source = _full_parameter(source)
    ast.parse(source)
    run_dir = workdir / case
    run_dir.mkdir()
    (run_dir / Path(script).name).write_text(source)
    flags = sh_flags(_git_show(script.removesuffix(".py") + ".sh"))
    output_dir = run_dir / "output"
    flags.update(
        {
            "--model-id": str(workdir / f"tiny-{family}"),
            "--dataset-id": str(workdir / "self_cognition.jsonl"),
            "--output-dir": str(output_dir),
            **_SIZES,
            **changed,
        }
    )
    argv = [t for k, v in flags.items() for t in ((k,) if v is None else (k, v))]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={ranks}",
        "--standalone",
        Path(script).name,
        *argv,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(
        command, cwd=run_dir, env=env, capture_output=True, text=True, timeout=900
    )
    output = proc.stdout + proc.stderr
    noise = ("it/s]", "async save is deprecated", "While redistributing from")
    lines = [x for x in output.splitlines() if x.strip() and not any(n in x for n in noise)]
    tail = "\n".join(lines[-6:])
    print(f"\n$ {shlex.join(['torchrun', *command[3:]])}\n{tail}")
    assert proc.returncode == 0, output[-6000:]
    losses = _losses(output, r"metric: \{[^}]*'loss': '?([0-9.]+)")
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
    last = output_dir / LAST_SAVED.get(case, "last-checkpoint")
    saved = sorted(p.name for p in output_dir.iterdir())
    assert last.is_dir(), saved
    if "Eval metric" in output:  # the first evaluation is the best so far: it saves
        assert any(name.startswith("checkpoint-") for name in saved), saved
    if case.startswith(("fsdp2", "tp_lora", "ep_")):  # saved with save_optimizer=True
        assert (last / "train_state" / "twinkle_manifest.json").is_file()
    if case.startswith("ep_"):  # the adapter adapts the routed experts too
        adapter = json.loads((last / "adapter_config.json").read_text())
        assert sorted(adapter["target_parameters"]) == [
            "mlp.experts.down_proj",
            "mlp.experts.gate_up_proj",
        ]
    if case == "tp_moe":  # save('last-checkpoint', merge_lora=True): a plain HF model
        assert (last / "config.json").is_file() and not (last / "adapter_config.json").exists()
