package tokenizer

import (
	"hash/maphash"
	"sync"
)

// bpe is a byte-level BPE model working directly on raw bytes: vocabulary
// tokens are stored as the bytes they stand for (not in the byte-level
// alphabet), so no text is ever mapped to the alphabet while encoding.
type bpe struct {
	vocab        map[string]int32  // raw bytes -> id
	byteID       [256]int32        // id of each single byte
	merges       map[uint64]uint64 // (left<<32 | right) -> (rank<<32 | merged id)
	ignoreMerges bool              // a word that is itself in the vocab is one token (Llama 3)
	cache        wordCache
}

// maxCachedWord is the longest pre-token (in bytes) kept in the cache, as in
// HF tokenizers: longer words rarely repeat and would crowd out short ones.
const maxCachedWord = 256

func pairKey(a, b int32) uint64 { return uint64(uint32(a))<<32 | uint64(uint32(b)) }

// symbol is one current piece of a word being merged; pieces form a linked
// list over the word's byte positions.
type symbol struct {
	id         int32
	prev, next int32 // index of the neighbouring symbol, -1 at the ends
	size       int32 // bytes covered; 0 once merged into its left neighbour
}

// mergeCand is a candidate merge of symbol pos with its right neighbour.
type mergeCand struct {
	rank  uint32
	pos   int32
	newID int32
}

func (a mergeCand) less(b mergeCand) bool {
	return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos)
}

// bpeScratch holds the per-word buffers of the merge loop, reused through a
// sync.Pool so that a cache miss does not allocate beyond its result.
type bpeScratch struct {
	syms []symbol
	heap []mergeCand
}

var scratchPool = sync.Pool{New: func() any { return new(bpeScratch) }}

// encodeWord appends the ids of one pre-token (raw bytes) to out.
func (m *bpe) encodeWord(word string, out []int32) []int32 {
	if len(word) == 1 {
		return append(out, m.byteID[word[0]])
	}
	if m.ignoreMerges {
		if id, ok := m.vocab[word]; ok {
			return append(out, id)
		}
	}
	cacheable := len(word) <= maxCachedWord
	if cacheable {
		if ids, ok := m.cache.get(word); ok {
			return append(out, ids...)
		}
	}
	start := len(out)
	out = m.merge(word, out)
	if cacheable {
		m.cache.put(word, out[start:])
	}
	return out
}

// merge runs the BPE merges on word the way HF tokenizers does: repeatedly
// apply the lowest-ranked merge among adjacent pairs, leftmost first. A heap
// of candidates keeps this O(n log n) for long words (a 100 kB run of one
// letter must not be quadratic); stale candidates are skipped on pop.
func (m *bpe) merge(word string, out []int32) []int32 {
	sc := scratchPool.Get().(*bpeScratch)
	syms := sc.syms[:0]
	for i := 0; i < len(word); i++ {
		syms = append(syms, symbol{id: m.byteID[word[i]], prev: int32(i - 1), next: int32(i + 1), size: 1})
	}
	syms[len(syms)-1].next = -1
	h := sc.heap[:0]
	push := func(c mergeCand) {
		h = append(h, c)
		for j := len(h) - 1; j > 0; {
			p := (j - 1) / 2
			if !h[j].less(h[p]) {
				break
			}
			h[j], h[p] = h[p], h[j]
			j = p
		}
	}
	pop := func() mergeCand {
		top := h[0]
		last := len(h) - 1
		h[0] = h[last]
		h = h[:last]
		for j := 0; ; {
			l, r, small := 2*j+1, 2*j+2, j
			if l < len(h) && h[l].less(h[small]) {
				small = l
			}
			if r < len(h) && h[r].less(h[small]) {
				small = r
			}
			if small == j {
				break
			}
			h[j], h[small] = h[small], h[j]
			j = small
		}
		return top
	}
	consider := func(pos int32) {
		nx := syms[pos].next
		if nx < 0 {
			return
		}
		if v, ok := m.merges[pairKey(syms[pos].id, syms[nx].id)]; ok {
			push(mergeCand{rank: uint32(v >> 32), pos: pos, newID: int32(uint32(v))})
		}
	}
	for i := range syms {
		consider(int32(i))
	}
	for len(h) > 0 {
		c := pop()
		s := &syms[c.pos]
		if s.size == 0 || s.next < 0 {
			continue
		}
		nx := s.next
		v, ok := m.merges[pairKey(s.id, syms[nx].id)]
		if !ok || int32(uint32(v)) != c.newID {
			continue // the pair changed since this candidate was pushed
		}
		s.id = c.newID
		s.size += syms[nx].size
		syms[nx].size = 0
		s.next = syms[nx].next
		if s.next >= 0 {
			syms[s.next].prev = c.pos
		}
		if s.prev >= 0 {
			consider(s.prev)
		}
		consider(c.pos)
	}
	for i := int32(0); i >= 0; i = syms[i].next {
		out = append(out, syms[i].id)
	}
	sc.syms, sc.heap = syms, h
	scratchPool.Put(sc)
	return out
}

// wordCache maps pre-tokens to their ids. It is sharded so that concurrent
// Encode calls rarely contend, and bounded: a full shard is emptied, which
// is cheap and keeps memory flat on adversarial input.
type wordCache struct {
	seed   maphash.Seed
	shards [cacheShards]cacheShard
}

const (
	cacheShards   = 64
	shardCapacity = 4096 // 262144 words in all
)

type cacheShard struct {
	mu sync.RWMutex
	m  map[string][]int32
}

func (c *wordCache) init() {
	c.seed = maphash.MakeSeed()
	for i := range c.shards {
		c.shards[i].m = make(map[string][]int32)
	}
}

func (c *wordCache) shard(word string) *cacheShard {
	return &c.shards[maphash.String(c.seed, word)%cacheShards]
}

func (c *wordCache) get(word string) ([]int32, bool) {
	s := c.shard(word)
	s.mu.RLock()
	ids, ok := s.m[word]
	s.mu.RUnlock()
	return ids, ok
}

func (c *wordCache) put(word string, ids []int32) {
	s := c.shard(word)
	// Clone both: word points into the caller's text and ids into its output.
	k := string([]byte(word))
	v := append([]int32(nil), ids...)
	s.mu.Lock()
	if len(s.m) >= shardCapacity {
		clear(s.m)
	}
	s.m[k] = v
	s.mu.Unlock()
}
