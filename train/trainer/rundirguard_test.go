package trainer

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"sort"
	"testing"
)

func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	es, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	var ns []string
	for _, e := range es {
		ns = append(ns, e.Name())
	}
	sort.Strings(ns)
	return ns
}

// TestRunNeverStartedLeavesNothing: a run refused before step 1 (here a
// sample longer than seq_len, found once config.yaml, metrics.jsonl and
// tb/ are written), or stopped before it, removes the run directory it
// made, or, in one that existed, what it added (train.lock included);
// a run refused because another trainer holds the directory touches
// nothing; a run that wrote a checkpoint keeps everything.
func TestRunNeverStartedLeavesNothing(t *testing.T) {
	b := testCache(t)
	run := filepath.Join(t.TempDir(), "run")
	cfg := tinyConfig(t, b, run, "data.seq_len=16", "log.tensorboard=true")
	if _, err := Run(cfg, Options{Log: io.Discard}); err == nil {
		t.Fatal("seq_len 16 with 40-token samples trained")
	}
	if _, err := os.Stat(run); !os.IsNotExist(err) {
		t.Errorf("the refused run left %s: %v", run, dirNames(t, run))
	}
	// A directory that existed keeps what it held, and only that.
	os.MkdirAll(run, 0o755)
	os.WriteFile(filepath.Join(run, "notes.txt"), []byte("mine"), 0o644)
	if _, err := Run(cfg, Options{Log: io.Discard}); err == nil {
		t.Fatal("seq_len 16 trained")
	}
	if got := dirNames(t, run); len(got) != 1 || got[0] != "notes.txt" {
		t.Errorf("the refused run left %v in a directory that held notes.txt", got)
	}
	// Stopped before step 1.
	stop := make(chan struct{})
	close(stop)
	fresh := filepath.Join(t.TempDir(), "run2")
	res, err := Run(tinyConfig(t, b, fresh), Options{Log: io.Discard, Stop: stop})
	if err != nil || res == nil || !res.Interrupted {
		t.Fatalf("stopped run: %+v, %v", res, err)
	}
	if _, err := os.Stat(fresh); !os.IsNotExist(err) {
		t.Errorf("a run stopped before step 1 left %s: %v", fresh, dirNames(t, fresh))
	}
	// Locked by another trainer: nothing is removed.
	os.MkdirAll(fresh, 0o755)
	lock, err := lockRunDir(fresh)
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(fresh, "config.yaml"), []byte("x"), 0o644) // the holder's, written after the refused run looked
	if _, err := Run(tinyConfig(t, b, fresh), Options{Log: io.Discard}); !errors.Is(err, ErrLocked) {
		t.Fatalf("locked run dir: %v", err)
	}
	lock.unlock()
	if got := dirNames(t, fresh); len(got) != 2 {
		t.Errorf("a run refused for the lock changed the holder's directory: %v", got)
	}
	// A run that checkpoints and then fails keeps its directory.
	kept := filepath.Join(t.TempDir(), "run3")
	if _, err := Run(tinyConfig(t, b, kept, "train.max_steps=3", "checkpoint.every=1"), Options{Log: io.Discard}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(kept, "metrics.jsonl")); err != nil {
		t.Errorf("a finished run lost its metrics: %v", err)
	}
}
