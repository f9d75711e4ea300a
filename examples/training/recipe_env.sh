# Sourced by the recipes' train.sh: where the ranks run and how many. Reads FASTVIDEO_RECIPE_DEVICE (auto, the
# default: every GPU, one rank each, on a host with 2+, else 2 gloo ranks on the CPU; cuda: every GPU, also one:
# SP1; cpu), NPROC (overrides the rank count) and PY; sets `device` and `nproc`, or exits 2 on a bad value.
device="${FASTVIDEO_RECIPE_DEVICE:-auto}"
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
case "$device" in
  auto) if (( gpus >= 2 )); then device=cuda; else device=cpu; fi ;;
  cuda) if (( gpus < 1 )); then echo "train.sh: FASTVIDEO_RECIPE_DEVICE=cuda but no GPU is visible" >&2; exit 2; fi ;;
  cpu) ;;
  *) echo "train.sh: FASTVIDEO_RECIPE_DEVICE=$device must be auto, cuda or cpu" >&2; exit 2 ;;
esac
if [[ $device == cuda ]]; then nproc="${NPROC:-$gpus}"; else nproc="${NPROC:-2}"; fi
