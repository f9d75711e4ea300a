# Sourced by the recipes' train.sh: the launch environment both share. Exports the switches' defaults
# (FASTVIDEO_ULYSSES_A2A=auto, _LONG_TRAINING=chunked, _OVERLAP=0, each kept where set), NVLink multicast off and
# deterministic cuBLAS (so that the runs of the two switches compare bit for bit on GPUs too); then where the ranks
# run and how many: reads FASTVIDEO_RECIPE_DEVICE (auto, the default: every GPU, one rank each, on a host with 2+,
# else 2 gloo ranks on the CPU; cuda: every GPU, also one: SP1; cpu), NPROC (overrides the rank count) and PY; sets
# `device` and `nproc`, or exits 2 on a bad value; and prints the recipe's line on stderr.
export FASTVIDEO_ULYSSES_A2A="${FASTVIDEO_ULYSSES_A2A:-auto}"
export FASTVIDEO_ULYSSES_A2A_LONG_TRAINING="${FASTVIDEO_ULYSSES_A2A_LONG_TRAINING:-chunked}"
export FASTVIDEO_ULYSSES_A2A_OVERLAP="${FASTVIDEO_ULYSSES_A2A_OVERLAP:-0}"
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"  # never NVLink multicast on shared hosts
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
device="${FASTVIDEO_RECIPE_DEVICE:-auto}"
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
case "$device" in
  auto) if (( gpus >= 2 )); then device=cuda; else device=cpu; fi ;;
  cuda) if (( gpus < 1 )); then echo "train.sh: FASTVIDEO_RECIPE_DEVICE=cuda but no GPU is visible" >&2; exit 2; fi ;;
  cpu) ;;
  *) echo "train.sh: FASTVIDEO_RECIPE_DEVICE=$device must be auto, cuda or cpu" >&2; exit 2 ;;
esac
if [[ $device == cuda ]]; then nproc="${NPROC:-$gpus}"; else nproc="${NPROC:-2}"; fi
echo "recipe: FASTVIDEO_ULYSSES_A2A=$FASTVIDEO_ULYSSES_A2A FASTVIDEO_ULYSSES_A2A_LONG_TRAINING=$FASTVIDEO_ULYSSES_A2A_LONG_TRAINING FASTVIDEO_ULYSSES_A2A_OVERLAP=$FASTVIDEO_ULYSSES_A2A_OVERLAP, $nproc rank(s) on $device" >&2
