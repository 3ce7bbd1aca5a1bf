package infer

import (
	"math"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"testing"

	"distill/cache"
	"distill/cache/cachetest"
	"distill/compute/device"
)

func drawSamples() [][]int32 {
	s := [][]int32{{5, 17, 3}, make([]int32, 40), {999, 0, 999, 4}}
	for i := range s[1] {
		s[1][i] = int32((i * 37) % 1000)
	}
	return s
}

// fullDists is each position's full distribution at temperature T from
// the top-k kernel with k = V (an independent path: the backend's
// streaming top-k), in float64.
func fullDists(t *testing.T, m *Model, samples [][]int32, T float32) [][]float64 {
	t.Helper()
	V := m.Cfg.VocabSize
	ids, lps := m.Forward(samples, V, T)
	var out [][]float64
	for r := 0; r < len(ids)/V; r++ {
		p := make([]float64, V)
		for j := 0; j < V; j++ {
			p[ids[r*V+j]] = math.Exp(float64(lps[r*V+j]))
		}
		out = append(out, p)
	}
	return out
}

// TestDrawsMatchReference: ForwardDraws draws, id for id, what the
// package doc's inverse CDF (cachetest.Draws, float64) draws from the full
// distribution with the same uniforms, for both kinds and two
// temperatures, the samples forwarded together and one at a time (a
// position's draws do not depend on the batch); the tail mass is the
// reference's.
func TestDrawsMatchReference(t *testing.T) {
	m, err := Load(filepath.Join("testdata/golden", "qwen3"), device.CPU(0))
	if err != nil {
		t.Fatal(err)
	}
	samples := drawSamples()
	key := cache.DrawKey("dataset-A")
	U := func(s, tt, d int) float64 { return cache.DrawUniform(key, int64(100+s), tt, d) }
	for _, T := range []float32{1, 0.7} {
		full := fullDists(t, m, samples, T)
		for _, head := range []bool{false, true} {
			k := 0
			if head {
				k = 6
			}
			for _, split := range []bool{false, true} {
				how := map[bool]string{false: "one forward", true: "one forward per sample"}[split]
				const N = 64
				var ids []int32
				var res DrawResult
				if !split {
					ids, _, res = m.ForwardDraws(samples, k, T, Draws{N: N, Head: head, U: U})
				} else {
					res.N = []int32{}
					for s := range samples {
						U1 := func(_, tt, d int) float64 { return U(s, tt, d) }
						id1, _, r1 := m.ForwardDraws(samples[s:s+1], k, T, Draws{N: N, Head: head, U: U1})
						ids = append(ids, id1...)
						res.N, res.IDs, res.Counts = append(res.N, r1.N...), append(res.IDs, r1.IDs...), append(res.Counts, r1.Counts...)
						res.Tail = append(res.Tail, r1.Tail...)
					}
				}
				r, off := 0, 0
				for s, smp := range samples {
					for tt := range smp {
						var hd []int32
						if head {
							hd = ids[r*k : (r+1)*k]
						}
						drawn, tail := cachetest.Draws(full[r], hd, N, func(d int) float64 { return U(s, tt, d) })
						wantIDs, wantCounts := cache.Tally(drawn, nil, nil)
						n := int(res.N[r])
						if n != len(wantIDs) {
							t.Fatalf("T %g head %v, %s: sample %d position %d: %d distinct ids, reference %d", T, head, how, s, tt, n, len(wantIDs))
						}
						for j := 0; j < n; j++ {
							if res.IDs[off+j] != wantIDs[j] || res.Counts[off+j] != wantCounts[j] {
								t.Fatalf("T %g head %v, %s: sample %d position %d entry %d: (%d x%d), reference (%d x%d)", T, head, how, s, tt, j, res.IDs[off+j], res.Counts[off+j], wantIDs[j], wantCounts[j])
							}
						}
						if head && math.Abs(float64(res.Tail[r])-tail) > 1e-5*tail+1e-7 {
							t.Fatalf("T %g: sample %d position %d: tail mass %v, reference %v", T, s, tt, res.Tail[r], tail)
						}
						off += n
						r++
					}
				}
			}
		}
	}
}

// estimatorMSE is the mean over positions and keys of Σ_v (r̂_v - p_v)²,
// r̂ the target of the draws (count/N, or the head's p and
// tail·count/N), and the same expectation from the variance formula.
func estimatorMSE(t *testing.T, m *Model, samples [][]int32, full [][]float64, N, keys int, head bool) (mse, want float64) {
	t.Helper()
	k := 0
	if head {
		k = 4
	}
	var n int
	for seed := 0; seed < keys; seed++ {
		key := cache.DrawKey("rate-" + string(rune('A'+seed)))
		ids, lps, res := m.ForwardDraws(samples, k, 1, Draws{N: N, Head: head, U: func(s, tt, d int) float64 { return cache.DrawUniform(key, int64(s), tt, d) }})
		off := 0
		for r, p := range full {
			est := make([]float64, len(p))
			scale, exact := 1.0, map[int32]bool{}
			if head {
				scale = float64(res.Tail[r])
				for j := 0; j < k; j++ {
					est[ids[r*k+j]] = math.Exp(float64(lps[r*k+j]))
					exact[ids[r*k+j]] = true
				}
			}
			for j := 0; j < int(res.N[r]); j++ {
				est[res.IDs[off+j]] = scale * float64(res.Counts[off+j]) / float64(N)
			}
			off += int(res.N[r])
			var e, tail, sq float64
			for v := range p {
				e += (est[v] - p[v]) * (est[v] - p[v])
				if !exact[int32(v)] {
					tail += p[v]
					sq += p[v] * p[v]
				}
			}
			mse += e
			// Multinomial: E Σ (r̂-p)² = (tail² - Σ_tail p²)/N.
			want += (tail*tail - sq) / float64(N)
			n++
		}
	}
	return mse / float64(n), want / float64(n)
}

// TestDrawsUnbiasedRate: for fixed teacher distributions, the error of
// the sampled targets shrinks as 1/sqrt(draws): the RMS error times
// sqrt(N) stays at the multinomial's constant over N = 16..4096 (a biased
// estimator's error would level off at its bias instead), and the fitted
// log-log slope is -1/2. head+sampled's error is the lower one.
func TestDrawsUnbiasedRate(t *testing.T) {
	m, err := Load(filepath.Join("testdata/golden", "qwen3"), device.CPU(0))
	if err != nil {
		t.Fatal(err)
	}
	samples := [][]int32{{5, 17, 3, 8, 1, 900}, {42, 7}}
	full := fullDists(t, m, samples, 1)
	var xs, ys []float64
	for _, N := range []int{16, 64, 256, 1024, 4096} {
		mse, want := estimatorMSE(t, m, samples, full, N, 12, false)
		ratio := mse / want
		t.Logf("sampled N %4d: RMS error %.5f, expected %.5f (ratio of MSEs %.3f)", N, math.Sqrt(mse), math.Sqrt(want), ratio)
		if ratio < 0.6 || ratio > 1.6 {
			t.Errorf("N %d: MSE %.3g is %.2fx the unbiased estimator's %.3g", N, mse, ratio, want)
		}
		xs, ys = append(xs, math.Log(float64(N))), append(ys, 0.5*math.Log(mse))
		hmse, hwant := estimatorMSE(t, m, samples, full, N, 12, true)
		t.Logf("head+sampled (k 4) N %4d: RMS error %.5f, expected %.5f; MSE %.1fx lower than sampled", N, math.Sqrt(hmse), math.Sqrt(hwant), mse/hmse)
		if hmse >= mse {
			t.Errorf("N %d: head+sampled MSE %.3g not below sampled's %.3g", N, hmse, mse)
		}
	}
	var mx, my float64
	for i := range xs {
		mx, my = mx+xs[i]/float64(len(xs)), my+ys[i]/float64(len(xs))
	}
	var sxy, sxx float64
	for i := range xs {
		sxy += (xs[i] - mx) * (ys[i] - my)
		sxx += (xs[i] - mx) * (xs[i] - mx)
	}
	slope := sxy / sxx
	t.Logf("log RMS error vs log N: slope %.3f (1/sqrt(N): -0.5)", slope)
	if math.Abs(slope+0.5) > 0.08 {
		t.Errorf("error falls as N^%.3f, want N^-0.5", slope)
	}
}

func TestDrawsBadInput(t *testing.T) {
	u := func(int, int, int) float64 { return 0 }
	for _, tc := range []struct {
		d    Draws
		k    int
		want string
	}{
		{Draws{N: 0, U: u}, 0, "0 draws per position: want 1 to 4096"},
		{Draws{N: 5000, U: u}, 0, "5000 draws per position: want 1 to 4096"},
		{Draws{N: 5, Head: true, U: u}, 0, "head+sampled with k 0"},
	} {
		if err := ValidateDraws(tc.d, tc.k); err == nil || !contains(err.Error(), tc.want) {
			t.Errorf("%+v k %d: %v, want an error naming %q", tc.d.N, tc.k, err, tc.want)
		}
	}
}

func contains(s, sub string) bool {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return true
		}
	}
	return false
}

// TestSortUniforms checks sortUniforms against slices.Sort: rows of
// independent uniforms of several lengths (one bucket holding many where
// they repeat or crowd), values at 0 and just below 1, and a row with a
// value outside [0, 1) (slices.Sort's order, for PackUniforms to refuse).
func TestSortUniforms(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 10))
	for it := 0; it < 500; it++ {
		n := []int{1, 2, 3, 50, 64, 65, 1000}[it%7]
		u := make([]float64, n)
		for i := range u {
			switch it % 4 {
			case 1:
				u[i] = float64(r.IntN(3)) / 4 // repeats
			case 2:
				u[i] = 0.5 + r.Float64()*1e-3 // crowded in one bucket
			default:
				u[i] = float64(r.Uint64()>>11) / (1 << 53)
			}
		}
		if n > 2 {
			u[0], u[1] = 0, 1-0x1p-53
		}
		if it == 13 {
			u[n-1] = 1.5
		}
		want := slices.Clone(u)
		slices.Sort(want)
		sortUniforms(u, make([]float64, n), make([]int32, 2*n+1))
		if !slices.Equal(u, want) {
			t.Fatalf("case %d (%d uniforms): %v, want %v", it, n, u, want)
		}
	}
}
