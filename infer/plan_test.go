package infer

import (
	"math/rand/v2"
	"strings"
	"testing"

	"distill/compute"
	"distill/model"
)

// llama70B is Llama-3-70B's shape (its config.json's numbers).
func llama70B(t *testing.T) *model.Config {
	t.Helper()
	c, err := model.ParseConfig([]byte(`{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
		"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
		"max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": false, "hidden_act": "silu"}`))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// flatScratch stands in for the GPU's kernel scratch bound: 1 KiB a token.
func flatScratch(s compute.ForwardShape) int64 { return 1024 * int64(s.Tokens) }

// TestSplitLayers: the split is contiguous, covers every layer once, puts
// the embedding on the first stage and the head on the last, and its
// largest stage is the smallest any split into at most g contiguous
// stages can have (brute force over every split of small random models).
func TestSplitLayers(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for trial := 0; trial < 300; trial++ {
		n := 1 + r.IntN(7)
		layers := make([]int64, n)
		for i := range layers {
			layers[i] = 1 + r.Int64N(100)
		}
		embed, head := r.Int64N(60), r.Int64N(60)
		g := 1 + r.IntN(n)
		st := splitLayers(embed, layers, head, g)
		if len(st) == 0 || len(st) > g || !st[0].Embed || !st[len(st)-1].Head || st[0].FirstLayer != 0 || st[len(st)-1].EndLayer != n {
			t.Fatalf("layers %v, g %d: stages %+v", layers, g, st)
		}
		var worst int64
		for i, s := range st {
			if s.EndLayer <= s.FirstLayer || (i > 0 && s.FirstLayer != st[i-1].EndLayer) || s.Embed != (i == 0) || s.Head != (i == len(st)-1) {
				t.Fatalf("layers %v, g %d: stage %d of %+v", layers, g, i, st)
			}
			var b int64
			for _, l := range layers[s.FirstLayer:s.EndLayer] {
				b += l
			}
			if s.Embed {
				b += embed
			}
			if s.Head {
				b += head
			}
			if b != s.WeightBytes {
				t.Fatalf("stage %+v: %d bytes, says %d", s, b, s.WeightBytes)
			}
			worst = max(worst, b)
		}
		if best := bestSplit(embed, layers, head, g); worst != best {
			t.Fatalf("layers %v, embed %d, head %d, g %d: largest stage %d, the best split's %d (%+v)", layers, embed, head, g, worst, best, st)
		}
	}
}

// bestSplit is the smallest largest stage of any split of layers into 1
// to g contiguous non-empty stages, by enumeration.
func bestSplit(embed int64, layers []int64, head int64, g int) int64 {
	n := len(layers)
	best := int64(-1)
	for mask := 0; mask < 1<<(n-1); mask++ { // bit i: a cut after layer i
		cuts := 0
		for m := mask; m > 0; m &= m - 1 {
			cuts++
		}
		if cuts+1 > g {
			continue
		}
		var worst, cur int64
		cur = embed
		for i, l := range layers {
			cur += l
			if i == n-1 {
				cur += head
			}
			if i == n-1 || mask&(1<<i) != 0 {
				worst, cur = max(worst, cur), 0
			}
		}
		if best < 0 || worst < best {
			best = worst
		}
	}
	return best
}

// TestPlanTeacher: the weights are 2 bytes a parameter in BF16 and the
// stages share them out; a larger device or more GPUs never lower the
// budget; a budget's bytes fit and one more token's do not; FP8 halves
// the Linear weights only; Llama-3-70B does not fit one 80 GiB GPU and
// does fit two, and the errors name what is wrong.
func TestPlanTeacher(t *testing.T) {
	c := llama70B(t)
	plan := func(g int, mem int64, w WeightFormat) TeacherPlan {
		t.Helper()
		p, err := PlanTeacher(c, PlanOptions{GPUs: g, DeviceBytes: mem, Weights: w, K: 64, MaxLen: 4096, Scratch: flatScratch})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	one := plan(1, 80<<30, WeightsBF16)
	if w := one.Stages[0].WeightBytes; w != 2*c.Params() {
		t.Errorf("BF16 weights: %d bytes, want 2 x %d parameters", w, c.Params())
	}
	if one.Budget != 0 {
		t.Errorf("Llama-3-70B on one 80 GiB GPU: budget %d, want none", one.Budget)
	}
	prev := 0
	for _, g := range []int{2, 3, 4, 8} {
		p := plan(g, 80<<30, WeightsBF16)
		var sum int64
		for _, s := range p.Stages {
			sum += s.WeightBytes
			if s.Budget > 0 && s.WeightBytes+p.Reserve+s.BudgetBytes > 80<<30 {
				t.Errorf("%d GPUs: stage %+v over the device", g, s)
			}
			if s.Budget > 0 {
				st := s
				if stageBytes(c, p.Opts, &st, s.Budget+1)+s.WeightBytes+p.Reserve <= 80<<30 {
					t.Errorf("%d GPUs: stage %+v: one more token fits too", g, s)
				}
			}
		}
		if sum != 2*c.Params() {
			t.Errorf("%d GPUs: the stages hold %d bytes, want %d", g, sum, 2*c.Params())
		}
		if len(p.Stages) != g || p.Budget <= prev {
			t.Errorf("%d GPUs: %d stages, budget %d (fewer GPUs: %d)", g, len(p.Stages), p.Budget, prev)
		}
		prev = p.Budget
	}
	if big, small := plan(2, 141<<30, WeightsBF16), plan(2, 80<<30, WeightsBF16); big.Budget <= small.Budget {
		t.Errorf("budget %d on 141 GiB GPUs, %d on 80 GiB", big.Budget, small.Budget)
	}
	fp8 := plan(1, 80<<30, WeightsFP8)
	embed, _, head := weightBytes(c, WeightsBF16)
	if w := fp8.Stages[0].WeightBytes; w >= one.Stages[0].WeightBytes*6/10 || w <= embed+head {
		t.Errorf("FP8 weights %d bytes (BF16 %d): want about half, the embedding and head kept in BF16", w, one.Stages[0].WeightBytes)
	}
	for _, o := range []PlanOptions{{GPUs: 0, DeviceBytes: 1 << 30}, {GPUs: 81, DeviceBytes: 1 << 30}, {GPUs: 1, DeviceBytes: 1 << 30, Weights: "int4"}} {
		if _, err := PlanTeacher(c, o); err == nil || !strings.Contains(err.Error(), "infer: invalid teacher plan") {
			t.Errorf("%+v: %v, want a plan error", o, err)
		}
	}
}
