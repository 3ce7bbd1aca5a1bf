package cpu

import (
	"math/rand/v2"
	"testing"

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
