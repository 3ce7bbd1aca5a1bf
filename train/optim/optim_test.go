package optim

import (
	"math"
	"testing"

	"distill/compute"
	"distill/compute/device"
)

// hostGroup puts params p and grads g on a CPU backend and returns the
// group with p and g rebound to the backend's memory (host views), so the
// test reads and writes them directly.
func hostGroup(be compute.Backend, name string, p, g *[]float32, decay bool) Group {
	pt, gt := be.New(compute.F32, len(*p)), be.New(compute.F32, len(*g))
	hp, hg := be.(compute.Host).HostF32(pt), be.(compute.Host).HostF32(gt)
	copy(hp, *p)
	copy(hg, *g)
	*p, *g = hp, hg
	return Group{Name: name, Decay: decay, Params: hp, Grads: hg, Backend: be, P: pt, G: gt}
}

// TestAdamWHand runs four AdamW steps on three parameters (one group with
// decay, one without) and compares with the torch.optim.AdamW formula
// evaluated in float64 below, at 1e-6 relative (fp32 state).
func TestAdamWHand(t *testing.T) {
	cfg := AdamWConfig{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.1}
	p1 := []float32{1, -2, 0.5}
	p2 := []float32{0.25}
	g1 := make([]float32, 3)
	g2 := make([]float32, 1)
	be := device.CPU(2)
	a, err := NewAdamW(cfg, []Group{hostGroup(be, "w", &p1, &g1, true), hostGroup(be, "norm", &p2, &g2, false)})
	if err != nil {
		t.Fatal(err)
	}
	grads := [][]float64{{0.1, -0.3, 0.0, 2}, {-0.2, 0.1, 1e-3, -1}, {0.05, 0.05, -0.5, 0.5}, {1, -1, 0.2, 0}}
	lrs := []float64{1e-2, 2e-2, 5e-3, 1e-2}
	want := []float64{1, -2, 0.5, 0.25}
	m, v := make([]float64, 4), make([]float64, 4)
	for s := range grads {
		for i := 0; i < 3; i++ {
			g1[i] = float32(grads[s][i])
		}
		g2[0] = float32(grads[s][3])
		a.Step(lrs[s])
		st := float64(s + 1)
		for i := 0; i < 4; i++ {
			g := float64(float32(grads[s][i]))
			if i < 3 {
				want[i] *= 1 - lrs[s]*cfg.WeightDecay
			}
			m[i] = cfg.Beta1*m[i] + (1-cfg.Beta1)*g
			v[i] = cfg.Beta2*v[i] + (1-cfg.Beta2)*g*g
			mh := m[i] / (1 - math.Pow(cfg.Beta1, st))
			vh := v[i] / (1 - math.Pow(cfg.Beta2, st))
			// torch divides sqrt(v) by sqrt(bias_correction2) before
			// adding eps; the same as sqrt(vh) + eps.
			want[i] -= lrs[s] * mh / (math.Sqrt(vh) + cfg.Eps)
		}
		got := []float32{p1[0], p1[1], p1[2], p2[0]}
		for i := range got {
			if d := math.Abs(float64(got[i]) - want[i]); d > 1e-6*math.Abs(want[i])+1e-7 {
				t.Fatalf("step %d param %d = %.9g, want %.9g", s+1, i, got[i], want[i])
			}
		}
	}
	// First-step sanity by hand: |update| = lr for any nonzero gradient
	// (m̂/sqrt(v̂) = sign(g)), so p = 1·(1-1e-3) - 1e-2 = 0.989.
	q := []float32{1}
	gq := []float32{0.1}
	b, _ := NewAdamW(cfg, []Group{hostGroup(be, "q", &q, &gq, true)})
	b.Step(1e-2)
	if math.Abs(float64(q[0])-0.989) > 1e-6 {
		t.Fatalf("first step: %v, want 0.989", q[0])
	}
}

func TestClip(t *testing.T) {
	g1, g2 := []float32{3, 0}, []float32{4}
	p1, p2 := make([]float32, 2), make([]float32, 1)
	be := device.CPU(2)
	gs := []Group{hostGroup(be, "a", &p1, &g1, true), hostGroup(be, "b", &p2, &g2, false)}
	if n := ClipGradNorm(gs, 10); n != 5 || g1[0] != 3 {
		t.Fatalf("no-clip: norm %v grads %v", n, g1)
	}
	n := ClipGradNorm(gs, 1)
	c := 1 / (5 + 1e-6)
	if n != 5 || math.Abs(float64(g1[0])-3*c) > 1e-7 || math.Abs(float64(g2[0])-4*c) > 1e-7 {
		t.Fatalf("clip: norm %v grads %v %v", n, g1, g2)
	}
	g1[0] = float32(math.NaN())
	if n := ClipGradNorm(gs, 1); !math.IsNaN(n) {
		t.Fatalf("NaN grads gave norm %v", n)
	}
}

func TestSchedules(t *testing.T) {
	cos := Schedule{Kind: Cosine, Peak: 1e-3, Min: 1e-4, Warmup: 10, Total: 110}
	lin := Schedule{Kind: Linear, Peak: 1e-3, Min: 0, Warmup: 0, Total: 100}
	con := Schedule{Kind: Constant, Peak: 2e-4, Warmup: 4}
	for _, c := range []struct {
		s    Schedule
		step int
		want float64
	}{
		{cos, 1, 1e-4}, {cos, 5, 5e-4}, {cos, 10, 1e-3},
		{cos, 60, 1e-4 + 9e-4*0.5}, // halfway: cos(π/2) = 0
		{cos, 35, 1e-4 + 9e-4*0.5*(1+math.Cos(math.Pi/4))},
		{cos, 110, 1e-4}, {cos, 500, 1e-4},
		{lin, 1, 1e-3 * 0.99}, {lin, 50, 5e-4}, {lin, 100, 0},
		{con, 2, 1e-4}, {con, 4, 2e-4}, {con, 1000, 2e-4},
	} {
		if err := c.s.Validate(); err != nil {
			t.Fatal(err)
		}
		if got := c.s.LR(c.step); math.Abs(got-c.want) > 1e-15 {
			t.Errorf("%s step %d: lr %g, want %g", c.s.Kind, c.step, got, c.want)
		}
	}
	bad := []Schedule{{Kind: "exp", Peak: 1}, {Kind: Cosine, Peak: 1, Min: 2, Total: 5}, {Kind: Linear, Peak: 1, Warmup: 5, Total: 5}}
	for _, s := range bad {
		if s.Validate() == nil {
			t.Errorf("%+v validated", s)
		}
	}
	if (AdamWConfig{Beta1: 1, Beta2: 0.9, Eps: 1e-8}).Validate() == nil {
		t.Error("beta1 = 1 validated")
	}
}
