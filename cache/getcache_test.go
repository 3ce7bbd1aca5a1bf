package cache

import (
	"strings"
	"sync/atomic"
	"testing"
)

// countFS counts the chunk files read through it.
type countFS struct {
	FS
	chunkReads atomic.Int64
}

func (f *countFS) ReadFile(name string) ([]byte, error) {
	if strings.Contains(name, chunksDir) {
		f.chunkReads.Add(1)
	}
	return f.FS.ReadFile(name)
}

// TestSetGetCache: Get keeps 2 decoded chunks by default, so reading
// samples from 4 chunks in turn decodes a chunk on every call; with
// SetGetCache(4) each chunk is read once, and the samples are the same.
func TestSetGetCache(t *testing.T) {
	dir := t.TempDir()
	c, err := Create(dir, testManifest(24, EncodingLossless), nil)
	if err != nil {
		t.Fatal(err)
	}
	for a := int64(0); a < 24; a += 4 {
		fillRange(t, c, a, a+4)
	}
	c.Close()
	// Samples of chunks 0, 2, 3, 5 in turn, three rounds.
	var order []int64
	for round := 0; round < 3; round++ {
		for _, k := range []int64{0, 2, 3, 5} {
			order = append(order, 4*k+int64(round))
		}
	}
	read := func(n int) int64 {
		fs := &countFS{FS: OSFS}
		rd, err := OpenReaderOptions(&Options{FS: fs}, dir)
		if err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			rd.SetGetCache(n)
		}
		for _, i := range order {
			s, err := rd.Get(i)
			if err != nil {
				t.Fatal(err)
			}
			sameSample(t, s, testSample(i))
		}
		return fs.chunkReads.Load()
	}
	if got := read(0); got != int64(len(order)) {
		t.Fatalf("default Get cache: %d chunk reads for %d samples over 4 chunks in turn, want one per sample", got, len(order))
	}
	if got := read(4); got != 4 {
		t.Fatalf("SetGetCache(4): %d chunk reads, want 4 (each chunk once)", got)
	}
}
