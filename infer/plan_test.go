package infer

import (
	"errors"
	"math/rand/v2"
	"path/filepath"
	"strings"
	"testing"

	"distill/compute"
	"distill/model"
	"distill/model/decoder"
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

// flatScratch stands in for the GPU's kernel scratch bound: the layers'
// 1 KiB a token, the LM head's 2 KiB.
func flatScratch(s compute.ForwardShape) (layers, head int64) {
	if s.NoHead {
		return 1024 * int64(s.Tokens), 0
	}
	return 1024 * int64(s.Tokens), 2048 * int64(s.Tokens)
}

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
		if len(st) != g || !st[0].Embed || !st[len(st)-1].Head || st[0].FirstLayer != 0 || st[len(st)-1].EndLayer != n {
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
		for i, s := range p.Stages {
			sum += s.WeightBytes - s.CopyBytes
			if s.Budget > 0 && s.WeightBytes+p.Reserve+s.Bytes.Total() > 80<<30 {
				t.Errorf("%d GPUs: stage %+v over the device", g, s)
			}
			if s.Budget > 0 {
				if p.StageBytes(i, s.Budget+1).Total()+s.WeightBytes+p.Reserve <= 80<<30 {
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
	embed, _, head, _ := weightBytes(c, WeightsBF16)
	if w := fp8.Stages[0].WeightBytes; w >= one.Stages[0].WeightBytes*6/10 || w <= embed+head {
		t.Errorf("FP8 weights %d bytes (BF16 %d): want about half, the embedding and head kept in BF16", w, one.Stages[0].WeightBytes)
	}
	for _, o := range []PlanOptions{{GPUs: 0, DeviceBytes: 1 << 30}, {GPUs: 81, DeviceBytes: 1 << 30}, {GPUs: 1, DeviceBytes: 1 << 30, Weights: "int4"}, {GPUs: 1, DeviceBytes: 1 << 10}, {GPUs: 1, DeviceBytes: 256 << 20},
		{Devices: []int{0, 0}, DeviceBytes: 80 << 30}} { // two stages planned on one GPU's whole memory each
		if _, err := PlanTeacher(c, o); !errors.Is(err, ErrPlan) || strings.HasPrefix(err.Error(), "infer:") {
			t.Errorf("%+v: %v, want a plan error", o, err)
		}
	}
}

// exampleConfigs are the teachers of examples/model-configs.
func exampleConfigs(t *testing.T) map[string]*model.Config {
	t.Helper()
	dirs, _ := filepath.Glob("../examples/model-configs/*")
	if len(dirs) < 4 {
		t.Fatalf("found %d example configs, want at least 4", len(dirs))
	}
	out := map[string]*model.Config{}
	for _, d := range dirs {
		c, err := LoadConfigAt(filepath.Join(d, "config.json"))
		if err != nil {
			t.Fatal(err)
		}
		out[filepath.Base(d)] = c
	}
	return out
}

// TestPlanBalanced: on the example teachers (and a tied one), in BF16 and
// FP8, over 2 to 8 GPUs, the largest stage's weights are within one
// layer of the ideal (the total over the GPUs, copies aside): the largest
// layer, counting the embedding with the first and the head with the
// last.
func TestPlanBalanced(t *testing.T) {
	cfgs := exampleConfigs(t)
	tied := *cfgs["qwen3-8b"]
	tied.TieEmbeddings = true
	cfgs["qwen3-8b-tied"] = &tied
	for name, c := range cfgs {
		for _, w := range []WeightFormat{WeightsBF16, WeightsFP8} {
			for _, g := range []int{2, 3, 4, 5, 8} {
				st := SplitLayers(c, g, w)
				embed, layers, head, _ := weightBytes(c, w)
				if c.TieEmbeddings {
					head += embed // the last GPU's copy
				}
				total, item := embed+head, int64(0)
				for i, b := range layers {
					total += b
					if i == 0 {
						b += embed
					}
					if i == len(layers)-1 {
						b += head
					}
					item = max(item, b)
				}
				var worst, sum int64
				for _, s := range st {
					worst = max(worst, s.WeightBytes-s.CopyBytes)
					sum += s.WeightBytes - s.CopyBytes
				}
				if c.TieEmbeddings {
					sum += st[len(st)-1].CopyBytes // counted in total above
				}
				ideal := (total + int64(g) - 1) / int64(g)
				if len(st) != g || sum != total || worst > ideal+item {
					t.Errorf("%s %s on %d GPUs: %d stages, %d bytes (want %d), largest %d > ideal %d + one layer %d", name, w, g, len(st), sum, total, worst, ideal, item)
				}
			}
		}
	}
}

// TestPlanSums: a plan's per-GPU bytes are a single GPU's plan of the same
// forward plus the overheads of the split, each computed here on its own:
// the weights are the one GPU's plus the copies (each boundary's input
// norm, 2 bytes a hidden unit; a tied head's embedding); every GPU holds
// the decoder's activations and the layers' workspace (the LM head's
// scratch and the top-k outputs on the last only); every GPU but the last
// a hand-off of 6 bytes a token and hidden unit (fp32 residual, BF16
// normed input).
func TestPlanSums(t *testing.T) {
	for name, c := range exampleConfigs(t) {
		for _, tie := range []bool{false, true} {
			c := *c
			c.TieEmbeddings = tie
			const n, k = 3000, 64
			o := PlanOptions{DeviceBytes: 200 << 30, K: k, MaxLen: 2048, Scratch: flatScratch}
			o.GPUs = 1
			one, err := PlanTeacher(&c, o)
			if err != nil {
				t.Fatal(err)
			}
			single := one.StageBytes(0, n)
			for _, g := range []int{2, 4} {
				o.GPUs = g
				p, err := PlanTeacher(&c, o)
				if err != nil {
					t.Fatal(err)
				}
				var weights, bytes, copies, overhead int64
				for i, st := range p.Stages {
					b := p.StageBytes(i, n)
					weights += st.WeightBytes
					bytes += b.Total()
					if i+1 < len(p.Stages) {
						copies += 2 * int64(c.Hidden)
						overhead += decoder.ActivationBytesOf(&c, n, 0, compute.BF16) + 6*int64(n)*int64(c.Hidden) + 1024*n
						if b.LMHead != 0 || b.Handoff != 6*int64(n)*int64(c.Hidden) {
							t.Errorf("%s on %d GPUs: GPU %d: %+v: an LM head's scratch, or a hand-off not of 6 bytes a token and unit", name, g, i, b)
						}
					} else if b != single {
						t.Errorf("%s on %d GPUs: the last GPU's bytes %+v, one GPU's %+v", name, g, b, single)
					}
				}
				if tie {
					copies += 2 * int64(c.VocabSize) * int64(c.Hidden)
				}
				if w1 := one.Stages[0].WeightBytes; weights != w1+copies || w1 != 2*c.Params() {
					t.Errorf("%s (tied %v) on %d GPUs: weights %d, want one GPU's %d (2 x %d parameters) + copies %d", name, tie, g, weights, w1, c.Params(), copies)
				}
				if bytes != single.Total()+overhead {
					t.Errorf("%s (tied %v) on %d GPUs: %d bytes beside the weights, want one GPU's %d + the split's %d", name, tie, g, bytes, single.Total(), overhead)
				}
			}
		}
	}
}

// TestPlanCheckNamesGPU: a plan that does not fit names the GPU that is
// short, by its ordinal, and what to change: weights too large for one
// GPU; a budget too large for the first GPU (which holds the hand-off);
// draws only the last GPU holds.
func TestPlanCheckNamesGPU(t *testing.T) {
	c := llama70B(t)
	plan := func(o PlanOptions) TeacherPlan {
		t.Helper()
		o.K, o.MaxLen, o.Scratch = 64, 4096, flatScratch
		p, err := PlanTeacher(c, o)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	for _, tc := range []struct {
		p      TeacherPlan
		budget int
		want   string
	}{
		{plan(PlanOptions{GPUs: 1, DeviceBytes: 80 << 30}), 0, "GPU 0 (embedding, layers 0-79, norm, LM head): its 131.42 GiB weights exceed"},
		{plan(PlanOptions{Devices: []int{4, 5}, DeviceBytes: 70 << 30}), 1 << 20, "GPU 4 (embedding, layers 0-39): a forward of 1048576 tokens needs"},
		{plan(PlanOptions{Devices: []int{2, 7}, DeviceBytes: 80 << 30, Draws: 4096}), 47550, "GPU 7 (layers 40-79, norm, LM head): a forward of 47550 tokens"},
	} {
		err := tc.p.Check(tc.budget)
		if !errors.Is(err, ErrDeviceMemory) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("budget %d: %v, want an error naming %q", tc.budget, err, tc.want)
		}
		var out strings.Builder
		tc.p.Print(&out, tc.budget)
		if !strings.Contains(out.String(), "does not fit: ") || !strings.Contains(out.String(), tc.want) {
			t.Errorf("the printed plan does not say what does not fit:\n%s", out.String())
		}
	}
	if p := plan(PlanOptions{Devices: []int{2, 7}, DeviceBytes: 80 << 30}); p.Check(p.Budget) != nil || p.Check(p.Budget+1) == nil {
		t.Errorf("budget %d: %v; one more: %v", p.Budget, p.Check(p.Budget), p.Check(p.Budget+1))
	}
}
