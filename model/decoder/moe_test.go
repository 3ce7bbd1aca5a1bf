package decoder

import (
	"math"
	"math/rand/v2"
	"testing"

	"distill/compute/ref"
)

// TestRouterAuxIsHFs: RouterStats.Aux, from per-layer counts and
// probability sums, equals HF's load_balancing_loss_func as the float64
// reference writes it (the layers' logits concatenated, a (K,E)
// tokens_per_expert, E·Σ tokens_per_expert·router_prob_per_expert): the
// layers pooled, not averaged layer by layer. Unbalanced routers (the
// layers prefer different experts) tell the two apart.
func TestRouterAuxIsHFs(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	const E, K, T, L = 5, 2, 37, 3
	var logits [][]float64
	rs := RouterStats{Tokens: T, TopK: K}
	perLayer := 0.0
	for l := 0; l < L; l++ {
		lg := make([]float64, T*E)
		for i := range lg {
			lg[i] = r.NormFloat64() + float64(l*(i%E))*0.7
		}
		logits = append(logits, lg)
		cnt, ps := make([]int, E), make([]float64, E)
		for t0 := 0; t0 < T; t0++ {
			row := lg[t0*E : (t0+1)*E]
			p := make([]float64, E)
			lse := ref.LogSumExp(row, 1)
			for e := range row {
				p[e] = math.Exp(row[e] - lse)
				ps[e] += p[e]
			}
			for _, e := range ref.TopK(p, K) {
				cnt[e]++
			}
		}
		rs.Layers, rs.Counts, rs.ProbSums = append(rs.Layers, l), append(rs.Counts, cnt), append(rs.ProbSums, ps)
		perLayer += ref.LoadBalancingLoss(logits[l:], E, K) / L
	}
	want := ref.LoadBalancingLoss(logits, E, K)
	if got := rs.Aux(); math.Abs(got-want) > 1e-12 {
		t.Fatalf("aux %.15g, HF's formula %.15g", got, want)
	}
	if math.Abs(perLayer-want) < 1e-3 {
		t.Fatalf("the per-layer mean %.6g is as close as the pooled loss %.6g: the test cannot tell them apart", perLayer, want)
	}
	// A perfectly balanced router: f_e = K/E, P_e = 1/E, aux = K.
	bal := RouterStats{Tokens: 10, TopK: 2, Counts: [][]int{{5, 5, 5, 5}}, ProbSums: [][]float64{{2.5, 2.5, 2.5, 2.5}}}
	if got := bal.Aux(); math.Abs(got-2) > 1e-12 {
		t.Fatalf("balanced aux %g, want K = 2", got)
	}
}
