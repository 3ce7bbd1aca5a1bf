package tokenizer

import (
	"slices"
	"sync"
	"testing"
)

// TestConcurrentEncode runs Encode from several goroutines (the word cache is
// shared) and checks every result against a sequential run; run it with
// -race.
func TestConcurrentEncode(t *testing.T) {
	tok := loadModel(t, "qwen3")
	texts := corpus()[:400]
	want := make([][]int32, len(texts))
	for i, s := range texts {
		want[i] = tok.Encode(s)
	}
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for k := range texts {
				i := (k*7 + g*13) % len(texts)
				if got := tok.Encode(texts[i]); !slices.Equal(got, want[i]) {
					t.Errorf("goroutine %d: text %d differs", g, i)
					return
				}
			}
		}(g)
	}
	wg.Wait()
}
