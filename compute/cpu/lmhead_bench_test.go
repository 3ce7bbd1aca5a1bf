package cpu

import (
	"math/rand/v2"
	"slices"
	"syscall"
	"testing"
	"time"

	"distill/compute"
)

// BenchmarkLMHeadTopK: the streaming LM head of a Qwen3-vocab teacher
// (hidden 256, vocab 151936, k=64) over 512 tokens; GFLOP/s counts the GEMM.
func BenchmarkLMHeadTopK(b *testing.B) {
	be := New(0)
	r := rand.New(rand.NewPCG(1, 1))
	tokens, hidden, vocab, k := 512, 256, 151936, 64
	x, w := be.FromF32(randSlice(r, tokens*hidden)), be.FromF32(randSlice(r, vocab*hidden))
	ids, lps := be.New(compute.I32, tokens*k), be.New(compute.F32, tokens*k)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		be.LMHeadTopK(ids, lps, x, w, tokens, hidden, vocab, k)
	}
	s := b.Elapsed().Seconds() / float64(b.N)
	b.ReportMetric(float64(tokens)/s, "tokens/s")
	b.ReportMetric(2*float64(tokens*hidden*vocab)/s/1e9, "GFLOP/s")
}

// BenchmarkLMHeadSample: LMHeadSample against LMHeadTopK on the shape of
// BenchmarkLMHeadTopK (1024 tokens), the calls interleaved so that all
// three see the same machine: top-k k 16, sampled (k 0, N 50) and
// head+sampled (k 8, N 50). It reports tokens/s of each by wall time and
// by the process's CPU time (getrusage: steadier on a shared machine),
// and the sampled kinds' cost over top-k by CPU time. Random weights give
// a flat softmax, the worst case for the draws (nearly every draw lands in
// a block of its own).
//
//	go test ./compute/cpu -run '^$' -bench LMHeadSample -benchtime 5x
func BenchmarkLMHeadSample(b *testing.B) {
	be := New(0)
	r := rand.New(rand.NewPCG(1, 1))
	tokens, hidden, vocab, N := 1024, 256, 151936, 50
	x, w := be.FromF32(randSlice(r, tokens*hidden)), be.FromF32(randSlice(r, vocab*hidden))
	ids, lps := be.New(compute.I32, tokens*16), be.New(compute.F32, tokens*16)
	drawn, tail := be.New(compute.I32, tokens*N), be.New(compute.F32, tokens)
	u := make([]float64, tokens*N)
	for i := range u {
		u[i] = float64(r.Uint64()>>11) / (1 << 53)
	}
	for t := 0; t < tokens; t++ {
		slices.Sort(u[t*N : (t+1)*N])
	}
	pu := make([]int32, 2*len(u))
	compute.PackUniforms(pu, u)
	ut := be.FromI32(pu)
	calls := []func(){
		func() { be.LMHeadTopK(ids, lps, x, w, tokens, hidden, vocab, 16) },
		func() { be.LMHeadSample(ids, lps, drawn, tail, x, w, ut, tokens, hidden, vocab, 0, N, false) },
		func() { be.LMHeadSample(ids, lps, drawn, tail, x, w, ut, tokens, hidden, vocab, 8, N, true) },
	}
	var wall, cpu [3]float64
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j, f := range calls {
			w0, c0 := time.Now(), cpuSeconds()
			f()
			wall[j] += time.Since(w0).Seconds()
			cpu[j] += cpuSeconds() - c0
		}
	}
	for j, name := range []string{"topk-k16", "sampled-N50", "head+sampled-k8-N50"} {
		n := float64(b.N * tokens)
		b.ReportMetric(n/wall[j], name+"-tokens/s")
		b.Logf("%s: %.0f tokens/s wall, %.0f tokens per CPU-second (%+.1f%% CPU time against top-k)", name, n/wall[j], n/cpu[j], 100*(cpu[j]/cpu[0]-1))
	}
}

// cpuSeconds is the process's user and system CPU time so far.
func cpuSeconds() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		panic(err)
	}
	return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
}

// BenchmarkBlockLogits: LMHeadSample's step 4 alone on the shape of
// BenchmarkLMHeadSample (1024 rows, hidden 256, vocab 151936), 50 blocks
// a row drawn uniformly (a flat softmax: nearly every draw a block of
// its own), so every block's weights come from memory: the (row, block)
// pairs grouped by block and each block's logits computed again. It
// reports pairs/s, the block weights read in GB/s and the CPU time of a
// call (its workers' together).
//
//	go test ./compute/cpu -run '^$' -bench BlockLogits -benchtime 20x
func BenchmarkBlockLogits(b *testing.B) {
	be := New(0)
	r := rand.New(rand.NewPCG(1, 1))
	tokens, hidden, vocab, n := 1024, 256, 151936, 50
	xs, ws := randSlice(r, tokens*hidden), randSlice(r, vocab*hidden)
	nblk := (vocab + compute.SampleBlock - 1) / compute.SampleBlock
	var pairs []blockPair
	for t := 0; t < tokens; t++ {
		bl := make([]int32, n)
		for d := range bl {
			bl[d] = int32(r.IntN(nblk))
		}
		slices.Sort(bl)
		for d, v := range bl {
			if d > 0 && v == bl[d-1] {
				continue
			}
			pairs = append(pairs, blockPair{row: int32(t), blk: v, d0: int32(d), d1: int32(d + 1)})
		}
	}
	var sink [2]float32
	b.ResetTimer()
	c0 := cpuSeconds()
	for i := 0; i < b.N; i++ {
		be.blockLogits(slices.Clone(pairs), xs, ws, hidden, vocab, func(ps []blockPair, z []float32, _ int) { sink[ps[0].row&1] += z[0] })
	}
	s := b.Elapsed().Seconds() / float64(b.N)
	b.ReportMetric(float64(len(pairs))/s, "pairs/s")
	b.ReportMetric(float64(vocab*hidden*4)/s/1e9, "weights-GB/s")
	// CPU time (all workers): steadier than wall time on a shared machine.
	b.ReportMetric((cpuSeconds()-c0)*1e3/float64(b.N), "cpu-ms/op")
}
