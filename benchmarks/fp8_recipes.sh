#!/usr/bin/env bash
# fp8 recipes against bf16_pure on one GPU: one benchmarks/profile_step.py process per variant (compiled,
# synthetic batches, the config's own settings: fp8 attention on with fp8), each variant's JSON and log in
# OUT/CONFIG/VARIANT/, then a table of step times and ratios to bf16_pure. Each variant is its own process:
# the rowwise recipe switches a global Inductor flag (utils/precision/float8.py) that would reach the next one.
#
#   benchmarks/fp8_recipes.sh OUT CONFIG SECONDS [VARIANT ...] [-- train.py options]
#
# VARIANT: bf16_pure or an --fp8_recipe (tensorwise, rowwise, rowwise_with_gw_hp), RECIPE:noattn for fp8
# with bf16 attention, or RECIPE:noscales for fp8 recomputing the amax reductions under activation checkpointing
# (--fp8_save_scales false: the saved-amax policy timed on its own); default the first four. SECONDS is the time left for the whole list: each variant gets what
# remains (a variant started with under 60 s left is skipped), so the script ends inside a device call's limit.
# Example (one H100, 2026-11-26): benchmarks/fp8_recipes.sh $OUT vit_2b 560 -- --local_batch_size 4
set -u
out=$1; config=$2; budget=$3; shift 3
variants=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do variants+=("$1"); shift; done
[ $# -gt 0 ] && shift
[ ${#variants[@]} -eq 0 ] && variants=(bf16_pure tensorwise rowwise rowwise_with_gw_hp)
steps=${FP8_RECIPES_STEPS:-"--warmup_steps 4 --steps 3"}
start=$(date +%s)
for v in "${variants[@]}"; do
  left=$(( budget - ($(date +%s) - start) ))
  if [ "$left" -lt 60 ]; then echo "$config $v: skipped, ${left}s left"; continue; fi
  case $v in
    bf16_pure) mode=(--amp_modes bf16_pure) ;;
    *:noattn) mode=(--amp_modes fp8 --fp8_recipe "${v%:noattn}" --fp8_attention false) ;;
    *:noscales) mode=(--amp_modes fp8 --fp8_recipe "${v%:noscales}" --fp8_save_scales false) ;;
    *) mode=(--amp_modes fp8 --fp8_recipe "$v") ;;
  esac
  dir="$out/$config/${v/:/_}"; mkdir -p "$dir"; t0=$(date +%s)
  timeout -k 5 "$left" python3 benchmarks/profile_step.py --config "$config" --data_loader_config synthetic \
    "${mode[@]}" $steps --rows 20 --out "$dir" "$@" > "$dir/log.txt" 2>&1
  rc=$?
  echo "$config $v: rc $rc, $(( $(date +%s) - t0 )) s: $(grep -- ': step ' "$dir/log.txt" | tail -1)"
  [ $rc -ne 0 ] && tail -5 "$dir/log.txt"
done
python3 - "$out" "$config" <<'EOF'
import json, sys
from pathlib import Path
out, config = Path(sys.argv[1]), sys.argv[2]
rows = {p.parent.name: json.loads(p.read_text()) for p in sorted((out / config).glob("*/profile_*.json"))}
base = rows.get("bf16_pure")
print(f"| {config} | step ms | samples/s | of bf16_pure | peak allocated GiB | device |")
for name, r in rows.items():
    ratio = f"{base['step_ms'] / r['step_ms']:.3f}" if base else "-"
    peak = r["memory"].get("peak_allocated", r["memory"].get("peak_rss"))
    print(f"| {name} | {r['step_ms']:.1f} | {r['samples_per_s']:.2f} | {ratio} | {peak:.2f} | {r['device']} |")
summary = {name: {k: r[k] for k in ("step_ms", "samples_per_s", "profiled_step_ms", "memory", "global_batch",
                                    "device", "torch", "command")} for name, r in rows.items()}
(out / f"fp8_recipes_{config}.json").write_text(json.dumps(summary, indent=1))
EOF
