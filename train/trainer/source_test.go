package trainer

import (
	"fmt"
	"io"
	"math"
	"path/filepath"
	"testing"

	"distill/cache"
	"distill/train"
)

// countSource is a Source written for the test alone, with nothing but
// the interface: n samples of made-up text with no teacher, sample i
// counting up from i mod 11 for 8 + i mod 9 tokens, in index order epoch
// after epoch, each sample a row of its own. It records what the run
// asked of it.
type countSource struct {
	n       int64
	opened  bool
	closed  bool
	batches int
}

func (c *countSource) sample(i int64) (tokens []int32, mask []uint8) {
	for j := int64(0); j < 8+i%9; j++ {
		tokens = append(tokens, int32(1+(i%11+j)%90))
		mask = append(mask, 1)
	}
	return tokens, mask
}

func (c *countSource) Open(p SourceParams) (SourceInfo, error) {
	c.opened = true
	m := cache.Manifest{DatasetFingerprint: "count", Samples: c.n, VocabSize: p.Student.VocabSize, TokenizerFingerprint: p.TokenizerFingerprint}
	return SourceInfo{Manifest: m, Kind: "count", NoTeacher: true}, nil
}

func (c *countSource) Check(p SourceParams) error { return nil }

func (c *countSource) CheckEval(r cache.Range) error {
	if r.End > c.n {
		return fmt.Errorf("eval range %v past %d samples", r, c.n)
	}
	return nil
}

func (c *countSource) Batches(held cache.Range, epoch int, pos int64) (Batches, error) {
	c.batches++
	return &countBatches{src: c, held: held, epoch: epoch, pos: pos}, nil
}

func (c *countSource) EvalRows(r cache.Range) ([]*train.Batch, int, error) {
	var rows []*train.Batch
	for i := r.Start; i < r.End; i++ {
		tk, mk := c.sample(i)
		rows = append(rows, &train.Batch{Tokens: tk, Mask: mk, Starts: []int32{0, int32(len(tk))}})
	}
	return rows, len(rows), nil
}

func (c *countSource) Close() { c.closed = true }

// countBatches is countSource's training order from (epoch, pos).
type countBatches struct {
	src   *countSource
	held  cache.Range
	epoch int
	pos   int64
}

func (b *countBatches) Next(tokens int) ([]*train.Batch, error) {
	var rows []*train.Batch
	for n := 0; n < tokens; {
		if b.pos == b.src.n {
			b.epoch, b.pos = b.epoch+1, 0
		}
		i := b.pos
		b.pos++
		if i >= b.held.Start && i < b.held.End {
			continue
		}
		tk, mk := b.src.sample(i)
		rows = append(rows, &train.Batch{Tokens: tk, Mask: mk, Starts: []int32{0, int32(len(tk))}})
		n += len(tk)
	}
	return rows, nil
}

func (b *countBatches) Position() (int, int64) { return b.epoch, b.pos }
func (b *countBatches) Close()                 {}

// TestStubSource: a source added by implementing Source alone, in this
// file, trains without a change to the loop: the run opens and closes
// it, trains on its rows (the loss falls), evaluates on its held-out
// samples (eval_range [0, 16]), records its data position and
// fingerprint in the checkpoints, and resumes from that position bit
// for bit.
func TestStubSource(t *testing.T) {
	b := testCache(t) // the config names a cache; Options.Source replaces it
	over := []string{"distill.kd_weight=0", "distill.sft_weight=1", "train.max_steps=10", "eval.every=5"}
	dir := filepath.Join(t.TempDir(), "full")
	src := &countSource{n: 70}
	full, _ := run(t, tinyConfig(t, b, dir, over...), Options{Source: src})
	if !src.opened || !src.closed || src.batches != 1 {
		t.Fatalf("the run opened %v, closed %v, and started %d training orders of the source", src.opened, src.closed, src.batches)
	}
	if len(full.Steps) != 10 || len(full.Evals) != 2 {
		t.Fatalf("%d steps, %d evals", len(full.Steps), len(full.Evals))
	}
	if first, last := full.Steps[0].Loss, full.Steps[9].Loss; !(last < first) || full.Steps[0].KD != 0 {
		t.Fatalf("loss %v -> %v, kd %v: the student did not learn the counting", first, last, full.Steps[0].KD)
	}
	if es := full.Evals[1]; es.Samples != 16 || es.Tokens == 0 || !(es.CE < full.Evals[0].CE) {
		t.Fatalf("evals %+v: want the 16 held-out samples, CE falling", full.Evals)
	}
	_, st, err := LoadStudent(full.Checkpoint)
	if err != nil {
		t.Fatal(err)
	}
	// 10 steps of 150 tokens over samples 16..69 of 8..16 tokens each:
	// the order wrapped into epoch 1 at least once.
	if st.CacheDataset != "count" || st.Step != 10 || st.Epoch < 1 || st.EpochPos <= 16 {
		t.Fatalf("checkpoint state %+v: want the source's fingerprint and a data position past the held-out samples", st)
	}

	// Resume: the crash after step 6 loses steps 5 and 6 (checkpoint at
	// 4), and the resumed run starts the source's order at the saved
	// position and ends where the straight run did.
	dir = filepath.Join(t.TempDir(), "resumed")
	if _, err := Run(tinyConfig(t, b, dir, over...), Options{Source: &countSource{n: 70}, StopAfter: 6, Log: io.Discard}); err != nil {
		t.Fatal(err)
	}
	rest, _ := run(t, tinyConfig(t, b, dir, over...), Options{Source: &countSource{n: 70}})
	if rest.Resumed == "" || rest.Steps[0].Step != 5 {
		t.Fatalf("resumed from %q at step %d", rest.Resumed, rest.Steps[0].Step)
	}
	for _, s := range rest.Steps {
		if w := full.Steps[s.Step-1]; math.Float64bits(s.Loss) != math.Float64bits(w.Loss) || s.Tokens != w.Tokens {
			t.Fatalf("step %d after resume: loss %v (%d tokens), straight %v (%d tokens)", s.Step, s.Loss, s.Tokens, w.Loss, w.Tokens)
		}
	}
}
