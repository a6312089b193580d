set -u
S=$(date +%s); el() { echo $(( $(date +%s) - S )); }
bench/gpu_round_batch.sh setup > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD DEIMOS_TEST_DATA=$PWD/.peer/td OUT=${OUT:-/tmp/out}
python3 -c "import ggml; print('ggml-python ok')" 2>&1 | tail -1
timeout 170 python3 -m pytest -q -rfE tests/test_moe_gpu.py tests/test_offload.py tests/test_engine_kernels.py tests/test_triton_gemv_rows.py 2>&1 | tee $OUT/tests.txt | grep -E "passed|failed|FAILED|Error" | tail -12
echo "t=$(el)"
MLEVELS=1 MARGS="--greedy -p 512 -n 64" bench/gpu_round_14b.sh moe 2>&1 | tail -9
echo "t=$(el)"
MLEVELS=1 MARGS="--greedy -p 64 -n 48 --experts cpu --expert-cache-gib 6" bench/gpu_round_14b.sh moe 2>&1 | tail -10
echo "t=$(el)"
[ $(el) -lt 380 ] && SOAK_N=400 bench/gpu_round_14b.sh soak 2>&1 | tail -4
echo "t=$(el)"
cd $OUT && tar czf final.tgz *.txt 2>/dev/null; ls
