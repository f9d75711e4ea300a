#!/usr/bin/env bash
# Sourced by the Wan recipe where scripts/build_overlay.sh (the overlay builder) is not in the tree: builds the
# overlay in a cache outside the tree and exports FASTVIDEO_OVERLAY_PYTHONPATH (the overlay, its dependencies and
# the torchvision stand-in, in that order). Needs $PY (the Python that runs the recipe).
#
# The overlay: upstream fastvideo==0.2.1 (the pinned wheel, sha256-checked) unpacked, this repository's fastvideo/
# copied over it. The wheel and the dependencies come from $ROOT/.whl/ where it holds them (offline hosts),
# else from the package registry. FASTVIDEO_OVERLAY_CACHE (default ~/.cache/fastvideo-overlay) keeps the wheel,
# the unpacked upstream and the dependencies between runs; the overlay itself is re-copied on every run (0.3 s).
set -euo pipefail
: "${ROOT:?}" "${PY:?}"
_ov_cache="${FASTVIDEO_OVERLAY_CACHE:-$HOME/.cache/fastvideo-overlay}"
_ov_wheel="fastvideo-0.2.1-py3-none-any.whl"
_ov_sha=47e97668dc7b9f3fdeef7f2790e8057646913d344b79d0ff807a0ddcf9e68738
# What upstream's Wan DiT path imports at module level, pinned (torchvision: a stand-in, below).
_ov_deps=(cloudpickle==3.1.3 einops==0.8.2 imageio==2.38.2 pyyaml==6.0.4 diffusers==0.42.1 huggingface_hub==2.4.0
  requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1 charset_normalizer==3.5.3
  regex==2026.11.19 importlib_metadata==10.2.0 zipp==4.1.2 tqdm==4.70.1 httpx2==2.16.2 httpcore2==2.16.2
  truststore==0.10.5 h11==0.16.0 remote_pdb==2.1.0)
_ov_pip=("$PY" -m pip -q --disable-pip-version-check)
_ov_offline=()
if [ -d "$ROOT/.whl" ]; then _ov_offline=(--no-index --find-links "$ROOT/.whl"); fi
mkdir -p "$_ov_cache"
_ov_t0=$SECONDS
if [ ! -f "$_ov_cache/$_ov_wheel" ]; then
  if [ -f "$ROOT/.whl/$_ov_wheel" ]; then cp "$ROOT/.whl/$_ov_wheel" "$_ov_cache/"
  else "${_ov_pip[@]}" download --no-deps "${_ov_offline[@]}" fastvideo==0.2.1 -d "$_ov_cache"; fi
fi
echo "$_ov_sha  $_ov_cache/$_ov_wheel" | sha256sum -c --quiet - || {
  echo "overlay: $_ov_cache/$_ov_wheel does not have the pinned sha256; delete it and run again" >&2; exit 1; }
if [ ! -f "$_ov_cache/upstream/.done" ]; then
  rm -rf "$_ov_cache/upstream"
  "$PY" -m zipfile -e "$_ov_cache/$_ov_wheel" "$_ov_cache/upstream"
  touch "$_ov_cache/upstream/.done"
fi
_ov_stamp="${_ov_deps[*]}"
if [ "$(cat "$_ov_cache/deps/.done" 2>/dev/null)" != "$_ov_stamp" ]; then
  rm -rf "$_ov_cache/deps"
  "${_ov_pip[@]}" install --no-deps "${_ov_offline[@]}" --target "$_ov_cache/deps" "${_ov_deps[@]}"
  echo "$_ov_stamp" > "$_ov_cache/deps/.done"
fi
# torchvision cannot be installed beside the CPU torch builds: upstream imports one name of it at module level.
mkdir -p "$_ov_cache/standin/torchvision"
cat > "$_ov_cache/standin/torchvision/__init__.py" <<'PY'
"""A stand-in for torchvision: upstream FastVideo imports torchvision.utils.make_grid at module level."""
PY
cat > "$_ov_cache/standin/torchvision/utils.py" <<'PY'
def make_grid(*args, **kwargs):
    raise NotImplementedError("torchvision stand-in: make_grid needs the real torchvision")
PY
rm -rf "$_ov_cache/overlay"
cp -r "$_ov_cache/upstream" "$_ov_cache/overlay"
cp -r "$ROOT/fastvideo/." "$_ov_cache/overlay/fastvideo/"
export FASTVIDEO_OVERLAY_PYTHONPATH="$_ov_cache/overlay:$_ov_cache/deps:$_ov_cache/standin"
echo "overlay: upstream fastvideo 0.2.1 + this tree's fastvideo/ at $_ov_cache/overlay ($((SECONDS - _ov_t0)) s)" >&2
