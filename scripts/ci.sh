# Sourced by scripts/setup_env.sh and scripts/build_kernel.sh: CI as every command and test here reads it
# (tests/ci.py too): CI set to anything but empty, 0 or false (any case). Under CI what a machine lacks fails
# instead of skipping.
_fv_ci() { local v="${CI:-}"; v="${v,,}"; [[ -n $v && $v != false && $v != 0 ]]; }
