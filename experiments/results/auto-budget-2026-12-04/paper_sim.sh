set -e
P="python -m experiments.perf.auto_paper --seeds=5 --tokens=256"
T30="8:6.34,16:8.38,32:9.01,64:9.50,128:9.94"
run() { echo "### $1"; shift; $P "$@" 2>&1 | grep -v xla_bridge; echo; }
for dt in "" "8:3,16:3.5,32:3.8,64:4.0,128:4.1"; do
echo "######## draft_tau='$dt'"
run "Qwen3-8B batch 1" --costs=0:4.476,16:5.453,32:5.697,64:6.134,128:7.056 --batch=1 --draft_tau="$dt"
run "Qwen3-8B batch 8" --costs=0:4.899,16:7.461,32:10.511,64:17.375,128:31.099 --batch=8 --draft_tau="$dt"
run "Qwen3-30B-A3B batch 1" --costs=0:5.763,16:12.117,32:14.158,64:16.702,128:19.209 --tau=$T30 --batch=1 --draft_tau="$dt"
run "Qwen3-30B-A3B batch 8" --costs=0:9.197,16:19.761 --tau=$T30 --batch=8 --draft_tau="$dt"
run "Moonlight-16B-A3B batch 1" --costs=0:3.224,8:7.269,16:8.61,32:9.759,64:10.436 --batch=1 --draft_tau="$dt"
run "Moonlight-16B-A3B batch 8" --costs=0:6.586,16:12.713 --batch=8 --draft_tau="$dt"
done
