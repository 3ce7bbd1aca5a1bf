package cuda

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"sort"
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

// TestForwardGoldens runs the whole teacher (package infer) on the CUDA
// backend over the golden checkpoints (llama with llama3 RoPE, llama with
// biases, qwen2, qwen3, qwen3_moe; BF16 weights) and compares with the fp32
// goldens. BF16 activations at every GEMM input make the CUDA teacher
// differ from fp32 by up to a few 1e-2 in log-prob on these peaked
// distributions (mean 0.003 to 0.01 on the emulator); ids may swap only
// where the golden log-probs are within 0.05 of each other. Bounds: top-1
// agreement >= 96%, ids outside near-ties >= 97%, mean |Δ log-prob| <=
// 0.015, max <= 0.15;
// for MoE max <= 0.5: where BF16 noise flips a near-tie between two
// experts' router scores, that position's distribution moves by more (two
// of the 171 positions, by 0.19 and 0.28 on the emulator).
func TestForwardGoldens(t *testing.T) {
	be := testBackend(t)
	for _, dir := range goldenDirs(t) {
		t.Run(filepath.Base(dir), func(t *testing.T) {
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
				t.Logf("%s T=%v: %s", filepath.Base(dir), run.Temperature, &a)
				maxBound := 0.15
				if m.Cfg.NumExperts > 0 {
					maxBound = 0.5
				}
				if float64(a.top1) < 0.96*float64(a.positions) || float64(a.idsAgree) < 0.97*float64(a.ranks) ||
					a.sumDelta > 0.015*float64(a.entries) || a.maxDelta > maxBound {
					t.Errorf("T=%v: %s; want top-1 >= 96%%, ids >= 97%%, mean |Δ| <= 0.015, max |Δ| <= %g", run.Temperature, &a, maxBound)
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
