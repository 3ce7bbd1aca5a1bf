package trainer

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"distill/internal/atomicfile"
	"distill/train/tbevent"
)

// sinks are where a run's numbers and lines go: metrics.jsonl and the
// TensorBoard events (metrics), the progress bar or its periodic lines
// (progress), and the run's log.
type sinks struct {
	mw   *metrics
	prog *progress
	log  io.Writer
	// evalTeacher: the evals score against a teacher (eval.cache) even
	// where training has none.
	evalTeacher bool
}

// train records a step: its metrics line and event, then its progress.
func (k *sinks) train(sm StepMetrics) error {
	if err := k.mw.train(sm); err != nil {
		return err
	}
	k.prog.step(sm)
	return nil
}

// eval records an eval: its log line, its metrics line and event.
func (k *sinks) eval(step int, es EvalStats) error {
	k.prog.clear()
	if k.prog.sft && !k.evalTeacher { // no teacher: no KD to show
		fmt.Fprintf(k.log, "eval step %d: ce %.4f token_acc %.4f (%d tokens, %d samples)\n", step, es.CE, es.TokenAccuracy, es.Tokens, es.Samples)
	} else {
		fmt.Fprintf(k.log, "eval step %d: loss %.4f kd %.4f ce %.4f token_acc %.4f top1_agree %.4f%s (%d tokens)\n", step, es.Loss, es.KD, es.CE, es.TokenAccuracy, es.Top1Agreement, teachersLine(es.Teachers), es.Tokens)
	}
	return k.mw.eval(step, es)
}

// skipped says that a step's update was skipped for its gradient norm.
func (k *sinks) skipped(step int, sm StepMetrics) {
	k.prog.clear()
	if k.prog.sft { // no teacher: no KD to show
		fmt.Fprintf(k.log, "step %d: gradient norm %g (loss %g, ce %g): update skipped\n", step, sm.GradNorm, sm.Loss, sm.CE)
	} else {
		fmt.Fprintf(k.log, "step %d: gradient norm %g (loss %g, kd %g, ce %g): update skipped\n", step, sm.GradNorm, sm.Loss, sm.KD, sm.CE)
	}
}

// clear ends the progress bar's line before other output.
func (k *sinks) clear() { k.prog.clear() }

// metrics writes metrics.jsonl and the TensorBoard events.
type metrics struct {
	f  *os.File
	w  *bufio.Writer
	tb *tbevent.Writer
}

// openMetrics opens metrics.jsonl for appending, first dropping lines of
// steps after step (written by a run that died after its last checkpoint:
// the resumed run writes them again).
func openMetrics(cfg *Config, step int) (*metrics, error) {
	path := filepath.Join(cfg.RunDir, "metrics.jsonl")
	if b, err := os.ReadFile(path); err == nil {
		var keep bytes.Buffer
		for _, line := range bytes.SplitAfter(b, []byte("\n")) {
			var l struct {
				Step int `json:"step"`
			}
			if len(bytes.TrimSpace(line)) == 0 || !bytes.HasSuffix(line, []byte("\n")) {
				continue // a torn last line
			}
			if json.Unmarshal(line, &l) == nil && l.Step <= step {
				keep.Write(line)
			}
		}
		if err := atomicfile.WriteFile(path, keep.Bytes(), 0o644); err != nil {
			return nil, err
		}
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, err
	}
	m := &metrics{f: f, w: bufio.NewWriter(f)}
	if cfg.Log.TensorBoard {
		if m.tb, err = tbevent.Create(filepath.Join(cfg.RunDir, "tb")); err != nil {
			f.Close()
			return nil, err
		}
		if step > 0 {
			// Resumed: TensorBoard drops what the earlier run logged past
			// its checkpoint, as metrics.jsonl was trimmed above.
			if err := m.tb.SessionStart(int64(step+1), time.Now()); err != nil {
				m.tb.Close()
				f.Close()
				return nil, err
			}
		}
	}
	return m, nil
}

func (m *metrics) train(sm StepMetrics) error {
	if m == nil { // a data-parallel rank other than 0
		return nil
	}
	b, err := marshalFinite(sm)
	if err != nil {
		return fmt.Errorf("metrics of step %d: %w", sm.Step, err)
	}
	if _, err := m.w.Write(append(b, '\n')); err != nil {
		return fmt.Errorf("writing metrics.jsonl: %w", err)
	}
	if m.tb != nil {
		sc := map[string]float64{
			"train/loss": sm.Loss, "train/kd": sm.KD, "train/ce": sm.CE, "train/lr": sm.LR, "train/grad_norm": sm.GradNorm,
			"perf/tokens_per_s": sm.TokensPerSec, "perf/data_s": sm.DataSeconds, "perf/gflop_per_s": sm.GFLOPs, "perf/peak_mem_gib": float64(sm.PeakMemBytes) / (1 << 30),
		}
		teacherScalars(sc, "train", sm.Teachers)
		if sm.ExpertShare != nil {
			sc["moe/aux_loss"] = sm.AuxLoss
			for e, v := range sm.ExpertShare {
				sc[fmt.Sprintf("moe/expert_share/%d", e)] = v
			}
		}
		return m.tb.Scalars(int64(sm.Step), time.Now(), sc)
	}
	return nil
}

func (m *metrics) eval(step int, es EvalStats) error {
	if m == nil {
		return nil
	}
	b, err := marshalFinite(struct {
		Type string `json:"type"`
		Step int    `json:"step"`
		EvalStats
	}{"eval", step, es})
	if err != nil {
		return fmt.Errorf("eval metrics of step %d: %w", step, err)
	}
	if _, err := m.w.Write(append(b, '\n')); err != nil {
		return fmt.Errorf("writing metrics.jsonl: %w", err)
	}
	if m.tb != nil {
		sc := map[string]float64{
			"eval/loss": es.Loss, "eval/kd": es.KD, "eval/ce": es.CE, "eval/token_accuracy": es.TokenAccuracy, "eval/top1_agreement": es.Top1Agreement,
		}
		teacherScalars(sc, "eval", es.Teachers)
		return m.tb.Scalars(int64(step), time.Now(), sc)
	}
	return nil
}

func (m *metrics) flush() error {
	if m == nil {
		return nil
	}
	if err := m.w.Flush(); err != nil {
		return err
	}
	if m.tb != nil {
		if err := m.tb.Flush(); err != nil {
			return err
		}
	}
	return m.f.Sync()
}

func (m *metrics) close() {
	m.flush()
	m.f.Close()
	if m.tb != nil {
		m.tb.Close()
	}
}
