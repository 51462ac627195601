"""Is the CUDA path correct and fast? Each stage in a process of its own, killed at its time
limit with every process it started; every result written as it completes. `bash
benchmarks/gpu_check.sh` runs it (under 10 minutes on one H200) and prints the summary; `--cpu`
runs every stage at toy sizes on the CPU (CI: tests/test_gpu_check.py).

    python -m benchmarks.gpu_check --out benchmarks/results          # a GPU
    python -m benchmarks.gpu_check --cpu --out /tmp/gpu_check         # toy sizes, CPU
    python -m benchmarks.gpu_check --summary benchmarks/results/gpu_check.jsonl

Stages, in the order they run (limits.LIMITS_S: each one's seconds; one module each in
stages/): environment (GPU, torch, TE, NCCL, TF32, CUDA_DEVICE_MAX_CONNECTIONS, HBM peak);
integration (with MEGATRON_LM_DIR set: Megatron-LM's pretrain_gpt.py through the drop-in,
logits-free off and on, digit and token reductions, DP 2 where there are 2 GPUs or on the CPU;
benchmarks/gpu_integration.py); correctness (numerical_lm_loss at N 16384 and 4093, V 151936,
N x V > 2^31, bf16 and strict fp32, against Megatron's vocab_parallel_cross_entropy and, on a
256-row slice, the fp64 reference); logits_free (numerical_linear_loss against the materialised
path at h 4096, both routes); speed (forward and backward apart, CUDA events, inputs made
outside the timed region, against Megatron's CE, its fused CE and TE's parallel CE; achieved
bytes/s against the traffic floor and HBM peak); memory (peak against the same and against the
logits+gradient floor); syncs (torch.cuda.set_sync_debug_mode and benchmarks/host_syncs.py);
recompiles (graphs over several N); cuda_graph (one capture of a forward + backward).

Each result is one JSON line in OUT/gpu_check.jsonl: {"stage", "check", "ok", ...}; "ok" is
true, false, or null for a figure with no pass mark (and for a stage that is skipped, with
"skipped": why). A stage that raises writes one row with ok false and the error; one killed at
its limit, or ended by a signal, gets that row from the driver, with the tail of its stderr
(OUT/gpu_check_<stage>.stderr, where its Python stacks are written just before the kill); the
next stage runs either way. Needs torch, megatron-core and del_megatron only (Transformer
Engine when present).

Modules: cli (the command line), limits (stages and their seconds), driver (each stage in a
process of its own), runner (one stage in this process), results (the JSON lines), report (the
summary), sizes, context and fixtures (what the stages share), stages/ (one module a stage).
"""
