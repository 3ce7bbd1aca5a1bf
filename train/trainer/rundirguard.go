package trainer

import (
	"errors"
	"os"
	"path/filepath"
)

// runDirGuard remembers what a run directory held before a run, so that
// a run that never started (refused before step 1, or stopped before
// it) leaves nothing behind, or only what it found there: not the
// directory, train.lock, config.yaml, metrics.jsonl or tb/ it made.
type runDirGuard struct {
	dir     string
	existed bool
	entries map[string]bool // top-level names before the run
	ckpt    string          // the newest checkpoint before the run
}

func guardRunDir(dir string) *runDirGuard {
	g := &runDirGuard{dir: dir, entries: map[string]bool{}}
	if dir == "" {
		return g
	}
	es, err := os.ReadDir(dir)
	if err != nil {
		return g // missing (or unreadable: MkdirAll then fails and there is nothing to remove)
	}
	g.existed = true
	for _, e := range es {
		g.entries[e.Name()] = true
	}
	g.ckpt, _ = LatestCheckpoint(dir)
	return g
}

// cleanup removes what the run added to its directory when it wrote no
// checkpoint and ended with an error or before its first step. A run
// refused for a locked directory touches nothing (it belongs to the
// running trainer), nor does one whose lock another trainer took since.
func (g *runDirGuard) cleanup(res *Result, err error) {
	started := err == nil && (res == nil || !res.Interrupted || res.Step > 0)
	if g.dir == "" || started || errors.Is(err, ErrLocked) {
		return
	}
	if ck, _ := LatestCheckpoint(g.dir); ck != g.ckpt {
		return // the run got as far as a checkpoint: keep all of it
	}
	lock, lerr := lockRunDir(g.dir)
	if lerr != nil {
		return
	}
	defer lock.unlock()
	if !g.existed {
		os.RemoveAll(g.dir)
		return
	}
	es, _ := os.ReadDir(g.dir)
	for _, e := range es {
		if !g.entries[e.Name()] {
			os.RemoveAll(filepath.Join(g.dir, e.Name()))
		}
	}
}
