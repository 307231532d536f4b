"""`bash scripts/dev.sh deps`: the pip requirements `install` would install, chosen from what a
(fake) `nvidia-smi` on PATH reports; and pyproject.toml's CUDA extras making the same choice."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEV = ROOT / "scripts" / "dev.sh"
SYSTEM_PATH = "/usr/bin:/bin"

SMI_HEADER = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.159.04             Driver Version: 580.159.04     CUDA Version: {cuda}     |
|-----------------------------------------+------------------------+----------------------+
"""


def _fake_smi(tmp_path: Path, gpus: int, cuda: str | None, fail_list: bool = False) -> Path:
    """A directory holding an `nvidia-smi` that lists `gpus` GPUs for -L and prints a header
    with `cuda` as the driver's CUDA version (no version line when None)."""
    d = tmp_path / "bin"
    d.mkdir()
    listing = "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-{i:08x}-fake)'\n"
                      for i in range(gpus))
    header = SMI_HEADER.format(cuda=cuda) if cuda else "NVIDIA-SMI has no version line\n"
    if fail_list:
        listing = "echo 'No devices were found' >&2; exit 6\n"
    script = ("#!/bin/bash\n"
              'if [ "${1:-}" = "-L" ]; then\n' + listing + "exit 0\nfi\n"
              f"cat <<'HDR'\n{header}HDR\n")
    smi = d / "nvidia-smi"
    smi.write_text(script)
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return d


def _deps(path: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VENV",)}
    env["PATH"] = path
    env["VENV"] = "/nonexistent/venv-must-not-be-created"
    out = subprocess.run(["bash", str(DEV), "deps"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert not Path("/nonexistent/venv-must-not-be-created").exists()
    return out.stdout.split()


def _jax_lines(reqs):
    """The requirements naming jax, jaxlib or cuda-python, in order."""
    name = lambda r: r.split("[")[0].split(">")[0].split("<")[0].split("=")[0]
    return [r for r in reqs if name(r) in ("jax", "jaxlib", "cuda-python")]


@pytest.mark.parametrize("cuda, extra, bindings", [
    ("13.0", "cuda13", "cuda-python>=13,<14"),
    ("13.2", "cuda13", "cuda-python>=13,<14"),
    ("14.1", "cuda13", "cuda-python>=13,<14"),
    ("12.8", "cuda12", "cuda-python>=12.8,<13"),
    ("12.4", "cuda12", "cuda-python>=12.8,<13"),
])
def test_gpu_listed_picks_the_cuda_plugin_by_driver_version(tmp_path, cuda, extra, bindings):
    reqs = _deps(f"{_fake_smi(tmp_path, 2, cuda)}:{SYSTEM_PATH}")
    # the plugin extra brings the matching jaxlib: no separate jaxlib line
    assert _jax_lines(reqs) == [f"jax[{extra}]>=0.11", bindings]


def test_gpu_without_version_line_takes_cuda12(tmp_path):
    reqs = _deps(f"{_fake_smi(tmp_path, 1, None)}:{SYSTEM_PATH}")
    assert _jax_lines(reqs) == ["jax[cuda12]>=0.11", "cuda-python>=12.8,<13"]


def test_nvidia_smi_listing_no_gpu_gives_plain_jax(tmp_path):
    reqs = _deps(f"{_fake_smi(tmp_path, 0, '13.0', fail_list=True)}:{SYSTEM_PATH}")
    assert _jax_lines(reqs) == ["jax>=0.11", "jaxlib>=0.11"]


def test_no_nvidia_smi_gives_plain_jax():
    if shutil.which("nvidia-smi", path=SYSTEM_PATH):
        pytest.skip(f"this machine has nvidia-smi in {SYSTEM_PATH}")
    reqs = _deps(SYSTEM_PATH)
    assert _jax_lines(reqs) == ["jax>=0.11", "jaxlib>=0.11"]
    for tool in ("nanobind>=2.4", "scikit-build-core>=0.10", "numpy", "pytest>=8"):
        assert tool in reqs


def test_install_uses_the_deps_list():
    text = DEV.read_text()
    assert "\ninstall() {\n  make_env\n" in text
    body = text[text.index("make_env() {"):]
    body = body[:body.index("\n}\n")]
    assert "mapfile -t reqs < <(requirements)" in body
    assert '"${reqs[@]}"' in body
    assert "jax>=" not in body and "numpy" not in body  # no second, hand-kept list


def test_pyproject_extras_match_the_gpu_choice(tmp_path):
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for cuda, name in (("13.0", "cuda13"), ("12.8", "cuda12")):
        sub = tmp_path / name
        sub.mkdir()
        reqs = _deps(f"{_fake_smi(sub, 1, cuda)}:{SYSTEM_PATH}")
        assert sorted(extras[name]) == sorted(_jax_lines(reqs))


def _fake_nvcc(d: Path) -> None:
    nvcc = d / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0'\n")
    nvcc.chmod(0o755)


def _cuda_choice(path: str, preset: str | None = None) -> tuple[str, str]:
    """(JAX_NVCOMM_CUDA after dev.sh's cuda_choice, its message) with `path` as PATH."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_NVCOMM_CUDA"}
    env["PATH"] = path
    if preset is not None:
        env["JAX_NVCOMM_CUDA"] = preset
    out = subprocess.run(["bash", "-c", f'source "{DEV}"; cuda_choice; echo "$JAX_NVCOMM_CUDA"'],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip(), out.stderr


def test_install_without_gpu_skips_the_cuda_part_and_says_so(tmp_path):
    bin_ = _fake_smi(tmp_path, 0, "13.0", fail_list=True)
    _fake_nvcc(bin_)                      # nvcc alone (this machine) does not build it
    value, said = _cuda_choice(f"{bin_}:{SYSTEM_PATH}")
    assert value == "OFF"
    assert "no NVIDIA GPU" in said and "JAX_NVCOMM_CUDA=ON" in said


def test_install_with_gpu_and_nvcc_builds_the_cuda_part(tmp_path):
    bin_ = _fake_smi(tmp_path, 2, "13.0")
    _fake_nvcc(bin_)
    value, said = _cuda_choice(f"{bin_}:{SYSTEM_PATH}")
    assert value == "ON" and "compiling the CUDA part" in said


def test_install_with_gpu_without_nvcc_says_what_is_missing(tmp_path):
    value, said = _cuda_choice(f"{_fake_smi(tmp_path, 1, '13.0')}:{SYSTEM_PATH}")
    assert value == "OFF" and "no nvcc" in said


def test_install_keeps_an_explicit_choice(tmp_path):
    bin_ = _fake_smi(tmp_path, 0, "13.0", fail_list=True)
    assert _cuda_choice(f"{bin_}:{SYSTEM_PATH}", preset="ON")[0] == "ON"


def _fake_venv(tmp_path: Path, body: str) -> Path:
    """A venv whose python, run as `python -m pip install ...`, runs `body` (a shell script)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text("#!/bin/bash\n" + body)
    py.chmod(0o755)
    return venv


def _build(venv: Path, cuda: str):
    env = {**os.environ, "VENV": str(venv), "JAX_NVCOMM_CUDA": cuda}
    return subprocess.run(["bash", "-c", f'source "{DEV}"; build_package'], env=env,
                          capture_output=True, text=True, timeout=60)


def test_cuda_build_shows_its_progress(tmp_path):
    # pip -v indents the build's lines by two spaces
    venv = _fake_venv(tmp_path, 'for i in 1 2 3; do echo "  [$i/3] Building CUDA object k$i.cu.o";'
                                ' echo "  noise $i"; sleep 0.3; done\n')
    out = _build(venv, "ON")
    assert out.returncode == 0, out.stderr
    assert [ln for ln in out.stderr.splitlines() if ln.startswith("[")] == [
        f"[{i}/3] Building CUDA object k{i}.cu.o" for i in (1, 2, 3)]
    assert "noise" not in out.stderr and (venv / "build.log").exists()


def test_failed_build_prints_the_end_of_its_log(tmp_path):
    venv = _fake_venv(tmp_path, 'echo "[1/2] Building x"; echo "error: x.cu:1: bad"; exit 3\n')
    out = _build(venv, "ON")
    assert out.returncode == 3
    assert "error: x.cu:1: bad" in out.stderr and "full log" in out.stderr


def test_build_package_takes_the_pip_command(tmp_path):
    """build_wheel.sh builds the wheel through the same function (args after `python -m pip`);
    without args it installs the checkout editable."""
    venv = _fake_venv(tmp_path, 'echo "pip-args: $*"\n')
    env = {**os.environ, "VENV": str(venv), "JAX_NVCOMM_CUDA": "OFF"}
    run = lambda args: subprocess.run(["bash", "-c", f'source "{DEV}"; build_package {args}'],
                                      env=env, capture_output=True, text=True, timeout=60)
    out = run("")
    assert out.returncode == 0, out.stderr
    assert "pip-args: -m pip install --no-build-isolation --no-deps -e . -q" in out.stdout
    out = run("wheel --no-deps -w /tmp/x .")
    assert "pip-args: -m pip wheel --no-deps -w /tmp/x . -q" in out.stdout, out.stdout


@pytest.mark.parametrize("soname, want", [
    (b"libcudart.so.13", "nvidia-cuda-runtime>=13,<14"),
    (b"libcudart.so.12", "nvidia-cuda-runtime-cu12>=12.8,<13"),
    (None, ""),
])
def test_a_wheel_gets_the_cuda_runtime_its_module_names(tmp_path, soname, want):
    import sys
    import zipfile
    whl = tmp_path / "jax_nvcomm-0.1.0-cp312-abi3-manylinux_2_34_x86_64.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("jax_nvcomm/_host.abi3.so", b"\x7fELF host")
        if soname:
            z.writestr("jax_nvcomm/_cuda.abi3.so", b"\x7fELF ..." + soname + b"\0...")
    env = {**os.environ, "VENV_PY": sys.executable}
    out = subprocess.run(["bash", "-c", f'source "{DEV}"; wheel_cuda_runtime "{whl}"'], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == want


def test_one_abi3_wheel_with_the_shared_cuda_runtime():
    """pyproject: a cp312-abi3 wheel, editable installs in redirect mode, the CUDA choice from
    the environment; CMakeLists: both modules on the stable ABI, _cuda on the shared runtime."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["scikit-build"]
    assert conf["wheel"]["py-api"] == "cp312"
    assert conf["editable"]["mode"] == "redirect"
    assert conf["cmake"]["define"]["JAX_NVCOMM_CUDA"] == {"env": "JAX_NVCOMM_CUDA",
                                                         "default": "AUTO"}
    cmake = (ROOT / "CMakeLists.txt").read_text()
    assert "nanobind_add_module(_host STABLE_ABI" in cmake
    assert "nanobind_add_module(_cuda STABLE_ABI" in cmake
    assert "CUDA::cudart)" in cmake and "cudart_static" not in cmake
    assert "CUDA_RUNTIME_LIBRARY Shared" in cmake and "$ORIGIN/../nvidia/" in cmake
