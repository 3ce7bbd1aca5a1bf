package trainer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"distill/model"
)

// shardedRun is three ranks at ZeRO 2 in one run directory, with a
// checkpoint every 2 steps.
func shardedRun(t *testing.T, dir string, n int, over ...string) []*Config {
	b := testCache(t)
	cfgs := make([]*Config, n)
	for i := range cfgs {
		cfgs[i] = tinyConfig(t, b, dir, append([]string{"checkpoint.every=2", "checkpoint.keep=5"}, over...)...)
	}
	return cfgs
}

// TestShardedCheckpoint: three ranks at ZeRO 2 write sharded checkpoints:
// a manifest naming three shards of the bytes on disk, whose pieces
// cover every tensor of the student exactly once; the same job saving
// gathered checkpoints ends with the same weights and moments bit for bit
// (the layout changes what is written, not what is trained); and
// `student export` of the sharded run, written tensor by tensor from the
// pieces, is byte for byte the export of the gathered run, in F32 and
// BF16.
func TestShardedCheckpoint(t *testing.T) {
	dir := t.TempDir()
	sharded, _ := runRanks(t, 3, shardedRun(t, filepath.Join(dir, "sharded"), 3, "train.zero=2"), nil)
	gathered, _ := runRanks(t, 3, shardedRun(t, filepath.Join(dir, "gathered"), 3, "train.zero=2", "checkpoint.layout=gathered"), nil)
	ck := sharded[0].Checkpoint
	if !isSharded(ck) || isSharded(gathered[0].Checkpoint) {
		t.Fatalf("checkpoints %s (sharded %v) and %s (sharded %v)", ck, isSharded(ck), gathered[0].Checkpoint, isSharded(gathered[0].Checkpoint))
	}
	var man shardManifest
	raw, err := os.ReadFile(filepath.Join(ck, shardManifestName))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &man); err != nil {
		t.Fatal(err)
	}
	if man.WorldSize != 3 || man.ZeRO != 2 || len(man.Shards) != 3 || man.Step != sharded[0].Step {
		t.Fatalf("manifest %+v: want 3 shards of ZeRO 2 at step %d", man, sharded[0].Step)
	}
	for r, e := range man.Shards {
		fi, err := os.Stat(filepath.Join(ck, e.File))
		if err != nil || e.File != shardFile(r, 3) || fi.Size() != e.Bytes || e.Pieces == 0 {
			t.Fatalf("shard %d: %+v on disk %v (%v)", r, e, fi, err)
		}
	}
	c, err := openSharded(ck)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := model.LoadConfig(ck)
	if err != nil {
		t.Fatal(err)
	}
	for _, ts := range cfg.Tensors() {
		for _, key := range []string{ts.Name, "exp_avg." + ts.Name, "exp_avg_sq." + ts.Name} {
			n, at := 0, 0
			for _, p := range c.pieces[key] {
				if p.off != at {
					t.Fatalf("%s: a piece at %d after the pieces ended at %d", key, p.off, at)
				}
				at += p.n
				n++
			}
			if want := numel(ts.Shape); at != want {
				t.Fatalf("%s: pieces cover %d of %d elements", key, at, want)
			}
		}
		delete(c.pieces, ts.Name)
		delete(c.pieces, "exp_avg."+ts.Name)
		delete(c.pieces, "exp_avg_sq."+ts.Name)
	}
	if len(c.pieces) != 0 {
		t.Fatalf("the shards hold pieces of tensors the student does not have: %v", c.pieces)
	}
	c.close()

	ws, ms := readCheckpoint(t, ck)
	wg, mg := readCheckpoint(t, gathered[0].Checkpoint)
	closeTensors(t, "sharded vs gathered layout (weights)", ws, wg, 0)
	closeTensors(t, "sharded vs gathered layout (moments)", ms, mg, 0)

	for _, format := range []string{"f32", "bf16"} {
		var files [2][]byte
		for i, run := range []string{"sharded", "gathered"} {
			out := filepath.Join(dir, "export-"+run+"-"+format)
			if _, err := Export(filepath.Join(dir, run), out, ExportOptions{Format: format, NoTokenizer: true}); err != nil {
				t.Fatalf("export %s of the %s run: %v", format, run, err)
			}
			if files[i], err = os.ReadFile(filepath.Join(out, "model.safetensors")); err != nil {
				t.Fatal(err)
			}
		}
		if !bytes.Equal(files[0], files[1]) {
			t.Errorf("export %s: the sharded run's model.safetensors (%d bytes) differs from the gathered run's (%d bytes)", format, len(files[0]), len(files[1]))
		}
	}
}

func numel(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}

// TestShardedResumeReshards: three ranks at ZeRO 2 stop after step 5 (a
// stop reaching rank 2 alone); two ranks at ZeRO 3 resume the sharded
// checkpoint, each reading its parts out of the three shards' pieces, and
// end where one uninterrupted process ends, within fp32 reordering. The
// same three ranks resumed at the same world size and stage end bit for
// bit where the uninterrupted three end.
func TestShardedResumeReshards(t *testing.T) {
	dir := t.TempDir()
	b := testCache(t)
	one, err := Run(tinyConfig(t, b, filepath.Join(dir, "one")), Options{Log: &bytes.Buffer{}})
	if err != nil {
		t.Fatal(err)
	}
	straight, _ := runRanks(t, 3, shardedRun(t, filepath.Join(dir, "straight"), 3, "train.zero=2"), nil)

	stopped := func(run string) {
		stops := []chan struct{}{make(chan struct{}), make(chan struct{}), make(chan struct{})}
		var once sync.Once
		testHookRow = func(step, row int) {
			if step == 5 {
				once.Do(func() { close(stops[2]) })
			}
		}
		defer func() { testHookRow = nil }()
		first, _ := runRanks(t, 3, shardedRun(t, filepath.Join(dir, run), 3, "train.zero=2"), stops)
		if !first[0].Interrupted || !isSharded(first[0].Checkpoint) {
			t.Fatalf("the first job: interrupted %v, checkpoint %s: want a stop and a sharded checkpoint", first[0].Interrupted, first[0].Checkpoint)
		}
	}

	stopped("same")
	again, _ := runRanks(t, 3, shardedRun(t, filepath.Join(dir, "same"), 3, "train.zero=2"), nil)
	last, want := again[0].Steps[len(again[0].Steps)-1], straight[0].Steps[len(straight[0].Steps)-1]
	if again[0].Resumed == "" || math.Float64bits(last.Loss) != math.Float64bits(want.Loss) || math.Float64bits(last.GradNorm) != math.Float64bits(want.GradNorm) {
		t.Errorf("3 ranks resumed at ZeRO 2 (from %q): last step loss %v grad_norm %v; uninterrupted: %v %v", again[0].Resumed, last.Loss, last.GradNorm, want.Loss, want.GradNorm)
	}
	closeWeights(t, "3 ranks resumed at ZeRO 2", straight[0].Checkpoint, again[0].Checkpoint, 0)
	closeMoments(t, "3 ranks resumed at ZeRO 2", straight[0].Checkpoint, again[0].Checkpoint, 0)

	stopped("other")
	res, _ := runRanks(t, 2, shardedRun(t, filepath.Join(dir, "other"), 2, "train.zero=3"), nil)
	w := one.Steps[len(one.Steps)-1]
	for i, r := range res {
		last := r.Steps[len(r.Steps)-1]
		if r.Resumed == "" || last.Step != w.Step || math.Abs(last.Loss-w.Loss) > 1e-4*w.Loss || math.Abs(last.GradNorm-w.GradNorm) > 1e-3*w.GradNorm {
			t.Errorf("rank %d of 2 at ZeRO 3 resuming 3 ranks' ZeRO 2 shards (from %q): step %d loss %v grad_norm %v; one process: step %d %v %v",
				i, r.Resumed, last.Step, last.Loss, last.GradNorm, w.Step, w.Loss, w.GradNorm)
		}
	}
	closeMoments(t, "2 ranks at ZeRO 3 resuming 3 at ZeRO 2", one.Checkpoint, res[0].Checkpoint, 1e-3)
	closeWeights(t, "2 ranks at ZeRO 3 resuming 3 at ZeRO 2", one.Checkpoint, res[0].Checkpoint, 1e-4)
}

// TestShardedCheckpointFailures: a rank that cannot write its shard (a
// full disk) fails the save on every rank, the error naming it; no
// temporary directory stays and the previous checkpoint is intact, and
// the job run again resumes from it and ends bit for bit where an
// uninterrupted job ends. A shard truncated after the save, and ranks
// that do not share the run directory, are errors that say so.
func TestShardedCheckpointFailures(t *testing.T) {
	dir := t.TempDir()
	straight, _ := runRanks(t, 2, shardedRun(t, filepath.Join(dir, "straight"), 2, "train.zero=1"), nil)

	run := filepath.Join(dir, "full")
	testHookShard = func(rank int) error {
		if rank == 1 && steps(run) == 1 { // step 4's save: step 2's is on disk
			return fmt.Errorf("write shard: %w", errNoSpace)
		}
		return nil
	}
	_, _, errs := runRanksErr(2, shardedRun(t, run, 2, "train.zero=1"), nil)
	testHookShard = nil
	if errs[0] == nil || !strings.Contains(errs[0].Error(), "rank(s) [1] failed to write their shards") {
		t.Fatalf("rank 0: %v, want the save to fail naming rank 1", errs[0])
	}
	if errs[1] == nil || !strings.Contains(errs[1].Error(), "rank 1: write shard: no space left") {
		t.Fatalf("rank 1: %v, want its own write error", errs[1])
	}
	if tmp, _ := filepath.Glob(filepath.Join(run, "checkpoints", ".tmp-*")); len(tmp) > 0 {
		t.Errorf("the failed save left %v", tmp)
	}
	if ck, _ := LatestCheckpoint(run); ck != checkpointDir(run, 2) || !isSharded(ck) {
		t.Fatalf("after the failed save the newest checkpoint is %q, want step 2's", ck)
	}
	again, _ := runRanks(t, 2, shardedRun(t, run, 2, "train.zero=1"), nil)
	if !strings.HasSuffix(again[0].Resumed, "step-00000002") {
		t.Fatalf("the rerun resumed from %q, want step 2's checkpoint", again[0].Resumed)
	}
	last, want := again[1].Steps[len(again[1].Steps)-1], straight[1].Steps[len(straight[1].Steps)-1]
	if math.Float64bits(last.Loss) != math.Float64bits(want.Loss) || math.Float64bits(last.GradNorm) != math.Float64bits(want.GradNorm) {
		t.Errorf("the rerun's last step: loss %v grad_norm %v; uninterrupted: %v %v", last.Loss, last.GradNorm, want.Loss, want.GradNorm)
	}

	// A torn shard.
	ck, _ := LatestCheckpoint(run)
	shard := filepath.Join(ck, shardFile(1, 2))
	fi, _ := os.Stat(shard)
	if err := os.Truncate(shard, fi.Size()-8); err != nil {
		t.Fatal(err)
	}
	_, err := Run(shardedRun(t, run, 1, "train.max_steps=8")[0], Options{Log: &bytes.Buffer{}})
	if !errors.Is(err, ErrResume) || !strings.Contains(err.Error(), shardFile(1, 2)) || !strings.Contains(err.Error(), "truncated") {
		t.Fatalf("resuming a truncated shard: %v", err)
	}

	// Ranks that do not share the run directory.
	b := testCache(t)
	cfgs := []*Config{tinyConfig(t, b, filepath.Join(dir, "r0"), "train.zero=1"), tinyConfig(t, b, filepath.Join(dir, "r1"), "train.zero=1")}
	_, _, errs = runRanksErr(2, cfgs, nil)
	if errs[1] == nil || !strings.Contains(errs[1].Error(), "every rank must see the same run_dir") {
		t.Fatalf("rank 1 with a run_dir of its own: %v", errs[1])
	}
	if errs[0] == nil {
		t.Fatalf("rank 0 saved while rank 1 could not")
	}
}

// errNoSpace stands for ENOSPC.
var errNoSpace = errors.New("no space left on device")

// steps is how many checkpoints run has.
func steps(run string) int {
	s, _ := listCheckpoints(run)
	return len(s)
}

// TestShardedExportNVFP4: two ranks of an NVFP4 QAD student at ZeRO 3
// write sharded checkpoints; `student export --format nvfp4` of the run,
// which quantizes tensor by tensor from the shards with the checkpoint's
// amax (train.WriteNVFP4From), writes the same bytes as the export of the
// same job's gathered checkpoint, which loads the whole student; a
// sharded run without QAD is refused naming quant: nvfp4.
func TestShardedExportNVFP4(t *testing.T) {
	dir := t.TempDir()
	qad := []string{"train.zero=3", "quant=nvfp4", "calib_batches=2"}
	runRanks(t, 2, shardedRun(t, filepath.Join(dir, "sharded"), 2, qad...), nil)
	runRanks(t, 2, shardedRun(t, filepath.Join(dir, "gathered"), 2, append(qad, "checkpoint.layout=gathered")...), nil)
	var files [2][]byte
	for i, run := range []string{"sharded", "gathered"} {
		out := filepath.Join(dir, "export-"+run)
		if _, err := Export(filepath.Join(dir, run), out, ExportOptions{Format: "nvfp4", NoTokenizer: true}); err != nil {
			t.Fatalf("export nvfp4 of the %s run: %v", run, err)
		}
		var err error
		if files[i], err = os.ReadFile(filepath.Join(out, "model.safetensors")); err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(files[0], files[1]) {
		t.Errorf("the sharded run's NVFP4 model.safetensors (%d bytes) differs from the gathered run's (%d bytes)", len(files[0]), len(files[1]))
	}
	runRanks(t, 2, shardedRun(t, filepath.Join(dir, "bf16"), 2, "train.zero=3"), nil)
	_, err := Export(filepath.Join(dir, "bf16"), filepath.Join(dir, "x"), ExportOptions{Format: "nvfp4", NoTokenizer: true})
	if err == nil || !strings.Contains(err.Error(), "quant: nvfp4") {
		t.Fatalf("nvfp4 export of a sharded run without QAD: %v", err)
	}
}

// TestShardedCheckpointIsNoHFDir: a sharded checkpoint given where an HF
// directory is expected (a teacher's --model, model.OpenWeights) is an
// error that says what it is and how to export it.
func TestShardedCheckpointIsNoHFDir(t *testing.T) {
	res, _ := runRanks(t, 2, shardedRun(t, filepath.Join(t.TempDir(), "run"), 2, "train.zero=1"), nil)
	_, err := model.OpenWeights(res[0].Checkpoint)
	if err == nil || !strings.Contains(err.Error(), "sharded training checkpoint") || !strings.Contains(err.Error(), "student export") {
		t.Fatalf("OpenWeights of a sharded checkpoint: %v", err)
	}
}
