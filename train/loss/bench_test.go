package loss

import (
	"math/rand"
	"testing"

	"distill/compute"
)

// BenchmarkHead is the fused LM head + KD loss alone, forward and backward,
// on 1024 tokens with hidden 256, vocabulary 32000 and k = 64, for each tail
// mode: the modes differ only in O(k) work per position, so their figures
// should agree within noise. The 2teachers cases are multi-teacher KD
// with two teachers' top-64 (independent ids).
//
//	go test ./train/loss -run '^$' -bench Head -benchtime 5x
func BenchmarkHead(b *testing.B) {
	const N, C, V, K = 1024, 256, 32000, 64
	rng := rand.New(rand.NewSource(1))
	x, w := make([]float32, N*C), make([]float32, V*C)
	for i := range x {
		x[i] = float32(rng.NormFloat64())
	}
	for i := range w {
		w[i] = float32(rng.NormFloat64() * 0.05)
	}
	tg := Targets{Tokens: make([]int32, N), Starts: []int32{0, 300, 500, 900, N}, Mask: make([]uint8, N), K: K,
		TopIDs: make([]int32, N*K), TopLP: make([]float32, N*K)}
	for t := 0; t < N; t++ {
		tg.Tokens[t] = int32(rng.Intn(V))
		tg.Mask[t] = 1
		for j, v := range rng.Perm(V)[:K] {
			tg.TopIDs[t*K+j] = int32(v)
			tg.TopLP[t*K+j] = float32(-2 - j)
		}
	}
	xt, wt := testBE.FromF32(x), testBE.FromF32(w)
	dx, dw := testBE.New(compute.F32, N*C), testBE.New(compute.F32, V*C)
	for _, tail := range []Tail{Bucket, Renormalize, Zero} {
		b.Run(string(tail), func(b *testing.B) {
			opt := Options{KD: FwdKL, Tail: tail, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
			h := &Head{Backend: testBE, V: V, C: C}
			for i := 0; i < b.N; i++ {
				if _, err := h.ForwardBackward(xt, wt, dx, dw, &tg, &opt, 0); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(N)*float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
		})
	}
	// Two teachers (the one above and another with independent ids) at
	// 0.5/0.5: pass 1 gathers their union, about 2k ids per position.
	t2 := Teacher{Weight: 0.5, K: K, TopIDs: make([]int32, N*K), TopLP: tg.TopLP}
	for t := 0; t < N; t++ {
		for j, v := range rng.Perm(V)[:K] {
			t2.TopIDs[t*K+j] = int32(v)
		}
	}
	mt := tg
	mt.K, mt.TopIDs, mt.TopLP = 0, nil, nil
	mt.Teachers = []Teacher{{Weight: 0.5, K: K, TopIDs: tg.TopIDs, TopLP: tg.TopLP}, t2}
	for _, tail := range []Tail{Bucket, Renormalize, Zero} {
		b.Run("2teachers/"+string(tail), func(b *testing.B) {
			opt := Options{KD: FwdKL, Tail: tail, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
			h := &Head{Backend: testBE, V: V, C: C}
			for i := 0; i < b.N; i++ {
				if _, err := h.ForwardBackward(xt, wt, dx, dw, &mt, &opt, 0); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(N)*float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
		})
	}
}
