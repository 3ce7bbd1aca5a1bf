package cuda

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"distill/compute"
	"distill/infer"
)

// goldenFile is infer/testdata/golden/*/golden.json: top-k of an fp32
// PyTorch re-implementation of HF's modeling files, each sample alone.
type goldenFile struct {
	K       int       `json:"k"`
	Samples [][]int32 `json:"samples"`
	Runs    []struct {
		Temperature float32       `json:"temperature"`
		IDs         [][][]int32   `json:"topk_ids"`
		LogProbs    [][][]float64 `json:"topk_logprobs"`
	} `json:"runs"`
}

// agreement compares a run's top-k with a reference's: the share of
// positions whose top-1 agrees, the share of (position, rank) ids that
// agree where the reference has no near-tie (|Δ| < tie) at that rank, and
// the largest |Δ log-prob| at equal ranks.
type agreement struct {
	positions, top1    int
	ranks, idsAgree    int
	entries            int
	maxDelta, sumDelta float64
}

func (a *agreement) add(gotID []int32, gotLP []float32, wantID []int32, wantLP []float64, tie float64) {
	k := len(wantID)
	a.positions++
	if gotID[0] == wantID[0] {
		a.top1++
	}
	for j := 0; j < k; j++ {
		d := math.Abs(float64(gotLP[j]) - wantLP[j])
		a.maxDelta = max(a.maxDelta, d)
		a.sumDelta += d
		a.entries++
		near := (j > 0 && wantLP[j-1]-wantLP[j] < tie) || (j+1 < k && wantLP[j]-wantLP[j+1] < tie)
		if near {
			continue
		}
		a.ranks++
		if gotID[j] == wantID[j] {
			a.idsAgree++
		}
	}
}

func (a *agreement) String() string {
	return fmtf("top-1 agreement %d/%d (%.2f%%), top-k ids outside near-ties %d/%d (%.2f%%), max |Δ log-prob| %.3g, mean %.3g",
		a.top1, a.positions, 100*float64(a.top1)/float64(a.positions), a.idsAgree, a.ranks,
		100*float64(a.idsAgree)/float64(max(a.ranks, 1)), a.maxDelta, a.sumDelta/float64(max(1, a.entries)))
}

// hfAgreementFile is $DISTILL_HF_GOLDENS/<checkpoint>.vs-fp32.json, which
// scripts/gpu/hf_goldens.py writes: HF transformers' own BF16 forward
// against the fp32 goldens, per temperature, counted as agreement.add
// counts ours (the same near-tie rule, tie 0.05).
type hfAgreementFile struct {
	Source string  `json:"source"`
	Tie    float64 `json:"tie"`
	Runs   []struct {
		Temperature float32 `json:"temperature"`
		Positions   int     `json:"positions"`
		Top1        int     `json:"top1"`
		Ranks       int     `json:"ranks"`
		IDsAgree    int     `json:"ids_agree"`
		Entries     int     `json:"entries"`
		MaxDelta    float64 `json:"max_delta"`
		SumDelta    float64 `json:"sum_delta"`
	} `json:"runs"`
}

// hfAgreement returns HF BF16's agreement with the fp32 goldens of
// checkpoint name at temperature temp, from $DISTILL_HF_GOLDENS; nil and
// why when there is none.
func hfAgreement(name string, temp float32) (*agreement, string) {
	dir := os.Getenv("DISTILL_HF_GOLDENS")
	if dir == "" {
		dir = hfBF16Figures
	}
	b, err := os.ReadFile(filepath.Join(dir, name+".vs-fp32.json"))
	if err != nil {
		return nil, err.Error()
	}
	var f hfAgreementFile
	if err := json.Unmarshal(b, &f); err != nil {
		return nil, fmtf("%s.vs-fp32.json: %v", name, err)
	}
	if f.Tie != 0.05 {
		return nil, fmtf("%s.vs-fp32.json counts near-ties within %g, not 0.05", name, f.Tie)
	}
	for _, r := range f.Runs {
		if r.Temperature == temp {
			return &agreement{positions: r.Positions, top1: r.Top1, ranks: r.Ranks, idsAgree: r.IDsAgree,
				entries: r.Entries, maxDelta: r.MaxDelta, sumDelta: r.SumDelta}, ""
		}
	}
	return nil, fmtf("%s.vs-fp32.json has no run at T=%v", name, temp)
}

// hfBF16Figures holds HF BF16's agreement with the goldens measured on an
// H200 (testdata/hf-bf16/README.md), used where $DISTILL_HF_GOLDENS does
// not name fresher ones.
const hfBF16Figures = "testdata/hf-bf16"

// The goldens' bounds on agreement (TestForwardGoldens): with HF BF16's
// figures, ours may fall short of HF's by the slack, and never below the
// floor; without them, the fixed bounds.
const (
	goldTop1Fixed, goldIDsFixed = 0.96, 0.97 // shares, without HF's figures
	goldTop1Floor, goldIDsFloor = 0.90, 0.95 // shares, with them
	goldTop1Slack, goldIDsSlack = 1, 0.02    // positions; a share of the counted ids
)

// TestForwardGoldens runs the whole teacher (package infer) on the CUDA
// backend over the golden checkpoints (llama with llama3 RoPE, llama with
// biases, qwen2, qwen3, qwen3_moe; BF16 weights) and compares with the fp32
// goldens. BF16 activations at every GEMM input make the CUDA teacher
// differ from fp32 by up to a few 1e-2 in log-prob on these peaked
// distributions (mean 0.003 to 0.01 on the emulator); ids may swap only
// where the golden log-probs are within 0.05 of each other.
//
// Bounds on agreement. The fair one is HF transformers' own BF16 forward
// on the same samples: its figures (<checkpoint>.vs-fp32.json, written by
// scripts/gpu/hf_goldens.py) are committed in testdata/hf-bf16 from an
// H200 run, and $DISTILL_HF_GOLDENS names fresher ones (the suite's
// goldens step). Ours must agree with the goldens at least as well as HF
// BF16 does, less a slack of one position for top-1 and of 2% of the
// counted ids for the ids outside near-ties (rounded up: 8 to 16 ids on
// these goldens, no more than one position's top-16, which one MoE router
// flip can move), and never below the floors, top-1 >= 90% and ids >= 95%
// (absolute sanity bounds: the CUDA and HF BF16 teachers agree on 93.6% of
// qwen3_moe's top-1s). Both figures are logged side by side. On the H200
// run of 2026-11-26, HF BF16 agreed on 161/171 (94.2%) of qwen3_moe's
// top-1s and ours on 164/171 (95.9%); on its ids at T=1, HF 395/398, ours
// 392/398; the emulator with BF16 activations gives 164/171 and 394/398.
// Where a checkpoint has no figures, the fixed bounds hold: top-1 >= 96%,
// ids outside near-ties >= 97%.
//
// Either way mean |Δ log-prob| <= 0.015 and max <= 0.15; for MoE max <=
// 0.5: where BF16 noise flips a near-tie between two experts' router
// scores, that position's distribution moves by more (two of the 171
// positions, by 0.19 and 0.28 on the emulator). The |Δ| bounds stay fixed:
// HF keeps its logits in BF16 (errors of a few 1e-2), so its |Δ| figures
// would only loosen them.
//
// It runs with both activation dtypes (Options.Activations): BF16, the
// default, and F32.
func TestForwardGoldens(t *testing.T) {
	for _, act := range []string{"bf16", "f32"} {
		t.Run("act="+act, func(t *testing.T) { forwardGoldens(t, testBackendWith(t, Options{Activations: act})) })
	}
}

func forwardGoldens(t *testing.T, be *Backend) {
	for _, dir := range goldenDirs(t) {
		name := filepath.Base(dir)
		t.Run(name, func(t *testing.T) {
			var g goldenFile
			b, err := os.ReadFile(filepath.Join(dir, "golden.json"))
			if err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal(b, &g); err != nil {
				t.Fatal(err)
			}
			m, err := infer.Load(dir, be)
			if err != nil {
				t.Fatal(err)
			}
			for _, run := range g.Runs {
				res, err := m.TopK(g.Samples, infer.Options{K: g.K, Temperature: run.Temperature})
				if err != nil {
					t.Fatal(err)
				}
				var a agreement
				for s := range g.Samples {
					for p := range g.Samples[s] {
						a.add(res[s].IDs[p*g.K:(p+1)*g.K], res[s].LogProbs[p*g.K:(p+1)*g.K], run.IDs[s][p], run.LogProbs[s][p], 0.05)
					}
				}
				t.Logf("%s T=%v: %s", name, run.Temperature, &a)
				wantTop1 := int(math.Ceil(goldTop1Fixed * float64(a.positions)))
				wantIDs := int(math.Ceil(goldIDsFixed * float64(a.ranks)))
				how := "fixed bounds"
				if hf, why := hfAgreement(name, run.Temperature); hf == nil {
					if os.Getenv("DISTILL_HF_GOLDENS") != "" {
						t.Logf("%s T=%v: no HF BF16 figures (%s): the fixed bounds", name, run.Temperature, why)
					}
				} else if hf.positions != a.positions || hf.ranks != a.ranks {
					t.Errorf("%s T=%v: HF BF16's figures count %d positions and %d ranks outside near-ties, ours %d and %d: not the same goldens",
						name, run.Temperature, hf.positions, hf.ranks, a.positions, a.ranks)
				} else {
					wantTop1 = max(hf.top1-goldTop1Slack, int(math.Ceil(goldTop1Floor*float64(a.positions))))
					idsSlack := int(math.Ceil(goldIDsSlack * float64(a.ranks)))
					wantIDs = max(hf.idsAgree-idsSlack, int(math.Ceil(goldIDsFloor*float64(a.ranks))))
					how = fmtf("HF BF16's less %d and %d, floors %g%% and %g%%", goldTop1Slack, idsSlack, 100*goldTop1Floor, 100*goldIDsFloor)
					t.Logf("%s T=%v: HF BF16 vs fp32: %s", name, run.Temperature, hf)
				}
				t.Logf("%s T=%v: bounds: top-1 >= %d/%d, ids >= %d/%d (%s); ours top-1 %d, ids %d",
					name, run.Temperature, wantTop1, a.positions, wantIDs, a.ranks, how, a.top1, a.idsAgree)
				maxBound := 0.15
				if m.Cfg.NumExperts > 0 {
					maxBound = 0.5
				}
				if a.top1 < wantTop1 || a.idsAgree < wantIDs || a.sumDelta > 0.015*float64(a.entries) || a.maxDelta > maxBound {
					t.Errorf("T=%v: %s; want top-1 >= %d/%d, ids >= %d/%d (%s), mean |Δ| <= 0.015, max |Δ| <= %g",
						run.Temperature, &a, wantTop1, a.positions, wantIDs, a.ranks, how, maxBound)
				}
			}
		})
	}
}

// TestForwardHFGoldens compares the CUDA teacher (and, for scale, the CPU
// one) with goldens made by HF transformers itself in BF16 on the GPU
// (scripts/gpu/hf_goldens.py writes $DISTILL_HF_GOLDENS/<checkpoint>.json;
// scripts/gpu-suite.sh runs both). Both sides round to BF16, at different
// places (HF keeps activations and logits in BF16, this backend only GEMM
// inputs), so the bounds are loose: top-1 agreement >= 90%, max |Δ
// log-prob| <= 1. The figures in the log are what the issue asks for.
func TestForwardHFGoldens(t *testing.T) {
	dir := os.Getenv("DISTILL_HF_GOLDENS")
	if dir == "" {
		t.Skip("DISTILL_HF_GOLDENS is not set (scripts/gpu-suite.sh makes HF goldens on the GPU machine)")
	}
	be := testBackend(t)
	found := 0
	for _, ck := range goldenDirs(t) {
		name := filepath.Base(ck)
		b, err := os.ReadFile(filepath.Join(dir, name+".json"))
		if err != nil {
			t.Logf("%s: no HF golden (%v)", name, err)
			continue
		}
		found++
		t.Run(name, func(t *testing.T) {
			var g goldenFile
			if err := json.Unmarshal(b, &g); err != nil {
				t.Fatal(err)
			}
			for _, side := range []compute.Backend{be, oracle} {
				m, err := infer.Load(ck, side)
				if err != nil {
					t.Fatal(err)
				}
				for _, run := range g.Runs {
					res, err := m.TopK(g.Samples, infer.Options{K: g.K, Temperature: run.Temperature})
					if err != nil {
						t.Fatal(err)
					}
					var a agreement
					for s := range g.Samples {
						for p := range g.Samples[s] {
							a.add(res[s].IDs[p*g.K:(p+1)*g.K], res[s].LogProbs[p*g.K:(p+1)*g.K], run.IDs[s][p], run.LogProbs[s][p], 0.05)
						}
					}
					t.Logf("%s: %s vs HF BF16, T=%v: %s", name, side.Name(), run.Temperature, &a)
					if float64(a.top1) < 0.9*float64(a.positions) || a.maxDelta > 1 {
						t.Errorf("%s vs HF BF16, T=%v: %s; want top-1 >= 90%%, max |Δ| <= 1", side.Name(), run.Temperature, &a)
					}
				}
			}
		})
	}
	if found == 0 {
		t.Fatalf("no HF goldens in %s", dir)
	}
}

// goldenDirs returns the golden checkpoints of package infer (llama with
// llama3 RoPE, llama with biases, qwen2, qwen3, qwen3_moe), sorted.
func goldenDirs(t *testing.T) []string {
	t.Helper()
	dirs, _ := filepath.Glob("../../infer/testdata/golden/*")
	if len(dirs) < 5 {
		t.Fatalf("found %d golden checkpoints, want 5", len(dirs))
	}
	sort.Strings(dirs)
	return dirs
}

// TestActivationsOption: Options.Activations (and $DISTILL_CUDA_ACT) pick
// the activation dtype the backend reports; an unknown one is an error of
// Open naming the choices.
func TestActivationsOption(t *testing.T) {
	for _, c := range []struct {
		opt, env string
		want     compute.DType
	}{{"", "", compute.BF16}, {"bf16", "", compute.BF16}, {"f32", "", compute.F32}, {"", "f32", compute.F32}, {"bf16", "f32", compute.BF16}} {
		t.Setenv("DISTILL_CUDA_ACT", c.env)
		if got := testBackendWith(t, Options{Activations: c.opt}).ActDType(); got != c.want {
			t.Errorf("Activations %q, DISTILL_CUDA_ACT %q: ActDType %v, want %v", c.opt, c.env, got, c.want)
		}
	}
	if !onGPU() {
		useEmu(t)
	}
	_, err := Open(Options{KernelCache: kernelCacheForTests(t), Activations: "fp16"})
	if err == nil || !strings.Contains(err.Error(), `activations "fp16": want bf16 or f32`) {
		t.Fatalf("Open with activations fp16: %v, want an error naming the choices", err)
	}
}
