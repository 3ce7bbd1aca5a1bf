package data

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// genJSONL writes n text records of about recBytes bytes each.
func genJSONL(t testing.TB, path string, n, recBytes int) int64 {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	w := bufio.NewWriterSize(f, 1<<20)
	body := strings.Repeat("lorem ipsum dolor sit amet ", recBytes/27+1)[:recBytes]
	for i := 0; i < n; i++ {
		fmt.Fprintf(w, `{"text":"%d %s"}`+"\n", i, body)
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	st, _ := f.Stat()
	f.Close()
	return st.Size()
}

func heapAfterGC() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// TestStreamingMemoryIsBounded indexes and tokenizes a 24 MB JSONL file in
// batches and checks the live heap stays far below the file size: the file
// is never loaded, only 8 bytes per record of offsets are kept. (The same
// code path serves a 10 GB file; 24 MB keeps the test fast on CI.)
func TestStreamingMemoryIsBounded(t *testing.T) {
	p := filepath.Join(t.TempDir(), "big.jsonl")
	const n = 48000
	size := genJSONL(t, p, n, 500)
	base := heapAfterGC()
	tok := newFakeTok()
	d, err := open([]Source{{Path: p}}, tok, nil, Options{NoEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if d.Len() != n {
		t.Fatalf("Len %d, want %d", d.Len(), n)
	}
	const limit = 8 << 20 // live heap above the baseline: index (0.5 MB) + one batch
	if h := heapAfterGC(); h > base+limit {
		t.Errorf("after indexing a %d MB file the heap grew by %d MB", size>>20, (h-base)>>20)
	}
	var peak uint64
	var tokens int64
	for a := int64(0); a < n; a += 1024 {
		s, err := d.Range(context.Background(), a, min(a+1024, n))
		if err != nil {
			t.Fatal(err)
		}
		for _, x := range s {
			tokens += int64(len(x.IDs))
		}
		if a%(16*1024) == 0 {
			peak = max(peak, heapAfterGC())
		}
	}
	if peak > base+limit {
		t.Errorf("streaming a %d MB file: live heap peaked %d MB above baseline", size>>20, (peak-base)>>20)
	}
	if tokens < size-int64(n)*20 {
		t.Errorf("tokenized %d tokens from a %d byte file", tokens, size)
	}
}

// BenchmarkIndexJSONL measures the indexing pass (hash + line offsets).
// Run: go test ./data -run XXX -bench IndexJSONL -benchtime 3x
func BenchmarkIndexJSONL(b *testing.B) {
	p := filepath.Join(b.TempDir(), "idx.jsonl")
	size := genJSONL(b, p, 100000, 1000)
	b.SetBytes(size)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		r, err := openJSONL(p)
		if err != nil {
			b.Fatal(err)
		}
		r.close()
	}
}

// BenchmarkRangeQwen3 measures tokenization of chat records with the real
// Qwen3 tokenizer and template (render, prefix renders, BPE, mask), in
// tokens/s, on one worker and on all cores.
// Run: go test ./data -run XXX -bench RangeQwen3 -benchtime 2x
func BenchmarkRangeQwen3(b *testing.B) {
	tok := loadReal(b, "qwen3")
	p := filepath.Join(b.TempDir(), "chat.jsonl")
	f, _ := os.Create(p)
	w := bufio.NewWriter(f)
	for i := 0; i < 2000; i++ {
		q := strings.Repeat(fmt.Sprintf("Question %d about distillation and caches? ", i), 4)
		a := strings.Repeat(fmt.Sprintf("Answer %d: the teacher's top-k log-probs are stored once. ", i), 8)
		fmt.Fprintf(w, `{"messages":[{"role":"system","content":"Be helpful."},{"role":"user","content":%q},{"role":"assistant","content":%q},{"role":"user","content":"More?"},{"role":"assistant","content":%q}]}`+"\n", q, a, a)
	}
	w.Flush()
	f.Close()
	for _, workers := range []int{1, runtime.GOMAXPROCS(0)} {
		b.Run(fmt.Sprintf("workers=%d", workers), func(b *testing.B) {
			d, err := Open([]Source{{Path: p}}, tok, Options{Workers: workers})
			if err != nil {
				b.Fatal(err)
			}
			defer d.Close()
			var tokens int64
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				s, err := d.Range(context.Background(), 0, d.Len())
				if err != nil {
					b.Fatal(err)
				}
				for _, x := range s {
					tokens += int64(len(x.IDs))
				}
			}
			b.ReportMetric(float64(tokens)/b.Elapsed().Seconds(), "tokens/s")
			b.ReportMetric(float64(int64(b.N)*d.Len())/b.Elapsed().Seconds(), "samples/s")
		})
	}
}
