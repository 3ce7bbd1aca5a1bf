package trainer

import (
	"io"
	"math"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"distill/compute"
	"distill/compute/cuda"
	"distill/train/testcache"
)

// stepHostWaits runs cfg and returns the host waits of the CUDA backend
// (cuda.Backend.CountHostWaits) in each step, from its first row to the
// next step's (the update, the metrics, the next rows' data included),
// with the step's rows; the last step, which runs into the run's end,
// is left out. It returns the run's result too.
func stepHostWaits(t *testing.T, cfg *Config) ([]stepWaits, *Result) {
	t.Helper()
	var be *cuda.Backend
	testHookBackend = func(x compute.Backend) { be, _ = x.(*cuda.Backend) }
	defer func() { testHookBackend = nil }()
	var steps []stepWaits
	testHookRow = func(step, row int) {
		if row == 0 {
			if len(steps) == 0 {
				be.CountHostWaits(true)
			} else {
				steps[len(steps)-1].waits = be.HostWaits()
			}
			steps = append(steps, stepWaits{step: step})
		}
		steps[len(steps)-1].rows++
	}
	defer func() { testHookRow = nil }()
	res, err := Run(cfg, Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	if be == nil || len(steps) < 2 {
		t.Fatalf("the run opened backend %v and ran %d steps", be, len(steps))
	}
	return steps[:len(steps)-1], res
}

type stepWaits struct {
	step, rows int
	waits      []cuda.HostWait
}

// fileLine drops a call site's "(file.go:line)" parts.
var fileLine = regexp.MustCompile(` \([^()]*\.go:\d+\)`)

// TestCUDAHostWaits: a training step on the CUDA backend, as the trainer
// runs it, makes the host wait for the GPU once: to read the gradient's
// norm, which the clip and the skip of a non-finite step decide on (the
// AdamW step's count, the bias corrections and the logs are the host's).
// Every other host wait counted before (on the emulator, with 3 or 4
// rows a step: 37 to 45 a step) is gone: the rows' uploads (token ids,
// sample starts, the RoPE tables, the attention groups' starts, the loss
// head's positions, labels, teacher ids and log-probs, the optimizer's
// tensor tables) go through the pinned staging ring, and the rows' loss
// values come back into pinned blocks, read after the norm. So for a
// dense student, with QAD and with LoRA, and for an MoE student with the
// load-balancing loss on: each MoE layer's routing statistics (the
// expert counts and probability sums) stay on the device, where the
// loss's gradient is computed from them (compute.MoERouting), and come
// back with the loss values, read after the norm. Each step's waits are
// printed. With Options.Pageable
// ($DISTILL_CUDA_PAGEABLE=1) the same run counts the pageable uploads
// and the loss values' downloads again, and trains the same bits.
func TestCUDAHostWaits(t *testing.T) {
	useCUDA(t)
	b := testCache(t)
	const clip = "download (*Backend).SumSquaresEach <- optim.sumSquares"
	cases := []struct {
		name   string
		cfg    func(t *testing.T, b *testcache.Built, dir string, over ...string) *Config
		over   []string
		perRow map[string]int // waits a row (beside the clip's one a step)
	}{
		{"qwen3", tinyConfig, nil, nil},
		{"qwen3 qad", tinyConfig, []string{"quant=nvfp4", "calib_batches=2"}, nil},
		{"qwen3 lora", tinyConfig, loraOver, nil},
		// Two MoE layers (moeConfig), the load-balancing loss on.
		{"qwen3_moe", moeConfig, nil, nil},
	}
	over := []string{"train.device=cuda", "eval.every=0", "checkpoint.every=0", "train.max_steps=4"}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := c.cfg(t, b, filepath.Join(t.TempDir(), "run"), append(over, c.over...)...)
			steps, _ := stepHostWaits(t, cfg)
			for _, s := range steps {
				got := map[string]int{}
				total := 0
				var lines []string
				for _, w := range s.waits {
					got[w.Kind+" "+fileLine.ReplaceAllString(w.Site, "")] += w.Count
					total += w.Count
					lines = append(lines, w.String())
				}
				t.Logf("step %d (%d rows): %d host waits\n%s", s.step, s.rows, total, strings.Join(lines, "\n"))
				want := map[string]int{clip: 1}
				for k, n := range c.perRow {
					want[k] += n * s.rows
				}
				for k, n := range want {
					if got[k] != n {
						t.Errorf("step %d (%d rows): %d host waits at %q, want %d", s.step, s.rows, got[k], k, n)
					}
				}
				for k, n := range got {
					if _, ok := want[k]; !ok {
						t.Errorf("step %d (%d rows): %d unexpected host waits at %q", s.step, s.rows, n, k)
					}
				}
			}
		})
	}
	// The staging off: the waits it removed come back, and the run's
	// losses and norms are the same bits.
	t.Run("pageable", func(t *testing.T) {
		_, staged := stepHostWaits(t, tinyConfig(t, b, filepath.Join(t.TempDir(), "staged"), over...))
		t.Setenv("DISTILL_CUDA_PAGEABLE", "1")
		steps, pageable := stepHostWaits(t, tinyConfig(t, b, filepath.Join(t.TempDir(), "pageable"), over...))
		for _, s := range steps {
			kinds := map[string]int{}
			for _, w := range s.waits {
				kinds[w.Kind] += w.Count
			}
			t.Logf("step %d (%d rows), pageable: %v", s.step, s.rows, kinds)
			// A row's uploads (at least its tokens, starts, RoPE tables and
			// loss positions) and its loss values' download; the
			// optimizer's tables; the clip's download.
			if kinds[cuda.WaitUpload] < 5*s.rows || kinds[cuda.WaitDownload] != s.rows+1 {
				t.Errorf("step %d (%d rows) with the staging off: waits %v, want at least %d pageable uploads and %d downloads",
					s.step, s.rows, kinds, 5*s.rows, s.rows+1)
			}
		}
		if len(staged.Steps) != len(pageable.Steps) {
			t.Fatalf("%d steps staged, %d pageable", len(staged.Steps), len(pageable.Steps))
		}
		for i, s := range staged.Steps {
			p := pageable.Steps[i]
			if math.Float64bits(s.Loss) != math.Float64bits(p.Loss) || math.Float64bits(s.GradNorm) != math.Float64bits(p.GradNorm) {
				t.Errorf("step %d: loss %.17g |g| %.17g staged, %.17g %.17g pageable", s.Step, s.Loss, s.GradNorm, p.Loss, p.GradNorm)
			}
		}
	})
}
