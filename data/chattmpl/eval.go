package chattmpl

import (
	"errors"
	"fmt"
	"math"
	"math/big"
	"strings"
)

// scope is one level of variable bindings. jinja2 gives every for-loop
// iteration and every macro call a fresh scope whose lookups fall through to
// the enclosing one; {% if %} and {% set %} do not open scopes.
//
// Scopes hold a handful of names each, so a slice beats a map here.
type scope struct {
	vars   []binding
	parent *scope
}

type binding struct {
	name string
	v    any
}

func (s *scope) lookup(name string) (any, bool) {
	for ; s != nil; s = s.parent {
		for i := len(s.vars) - 1; i >= 0; i-- {
			if s.vars[i].name == name {
				return s.vars[i].v, true
			}
		}
	}
	return nil, false
}

func (s *scope) local(name string) bool {
	for _, b := range s.vars {
		if b.name == name {
			return true
		}
	}
	return false
}

func (s *scope) set(name string, v any) {
	for i := range s.vars {
		if s.vars[i].name == name {
			s.vars[i].v = v
			return
		}
	}
	s.vars = append(s.vars, binding{name, v})
}

// renderer holds the state of one Execute call.
type renderer struct {
	out   *strings.Builder
	genOn func(start bool, pos int) // called at {% generation %} boundaries
	env   *env
	steps int
}

// errLoopCtl carries {% break %}/{% continue %} up to the enclosing loop.
type errLoopCtl struct{ brk bool }

func (errLoopCtl) Error() string { return "break/continue outside a loop" }

// maxSteps bounds the work of one render so a hostile template cannot spin
// forever (jinja2's sandbox bounds range() for the same reason).
const maxSteps = 50_000_000

func (r *renderer) rtErr(line int, err error) error {
	var e *Error
	if errors.As(err, &e) {
		if e.Line == 0 {
			e.Line = line // e.g. raise_exception(): locate the call
		}
		return err
	}
	if _, ok := err.(errLoopCtl); ok {
		return err
	}
	return &Error{Kind: ErrRender, Line: line, Msg: err.Error(), err: err}
}

func (r *renderer) execBody(body []node, sc *scope) error {
	for _, n := range body {
		if err := r.exec(n, sc); err != nil {
			return err
		}
	}
	return nil
}

func (r *renderer) exec(n node, sc *scope) error {
	r.steps++
	if r.steps > maxSteps {
		return &Error{Kind: ErrRender, Msg: fmt.Sprintf("template exceeded %d execution steps", maxSteps)}
	}
	switch n := n.(type) {
	case *textNode:
		r.out.WriteString(n.text)
	case *printNode:
		v, err := r.eval(n.x, sc)
		if err != nil {
			return err
		}
		r.out.WriteString(toStr(v))
	case *ifNode:
		for i, c := range n.conds {
			v, err := r.eval(c, sc)
			if err != nil {
				return err
			}
			if truthy(v) {
				return r.execBody(n.bodies[i], sc)
			}
		}
		return r.execBody(n.els, sc)
	case *forNode:
		return r.execFor(n, sc)
	case *setNode:
		v, err := r.eval(n.x, sc)
		if err != nil {
			return err
		}
		if n.nsVar != "" {
			obj, _ := sc.lookup(n.nsVar)
			ns, ok := obj.(*Namespace)
			if !ok {
				return &Error{Kind: ErrRender, Line: n.line, Msg: fmt.Sprintf("cannot assign attribute '%s' on '%s': it is a %s, not a namespace() object", n.targets[0], n.nsVar, typeName(obj))}
			}
			ns.attrs.Set(n.targets[0], v)
			return nil
		}
		return r.assign(n.targets, n.unpack, v, sc, n.line)
	case *setBlockNode:
		v, err := r.captureFiltered(n.body, n.filters, sc)
		if err != nil {
			return err
		}
		sc.set(n.name, v)
	case *macroNode:
		sc.set(n.name, &macro{node: n, defScope: sc, name: n.name})
	case *loopCtlNode:
		return errLoopCtl{brk: n.brk}
	case *generationNode:
		if r.genOn != nil {
			r.genOn(true, r.out.Len())
		}
		if err := r.execBody(n.body, sc); err != nil {
			return err
		}
		if r.genOn != nil {
			r.genOn(false, r.out.Len())
		}
	case *filterBlockNode:
		v, err := r.captureFiltered(n.body, n.filters, sc)
		if err != nil {
			return err
		}
		r.out.WriteString(toStr(v))
	case *withNode:
		inner := &scope{parent: sc}
		for i, name := range n.names {
			v, err := r.eval(n.xs[i], sc)
			if err != nil {
				return err
			}
			inner.set(name, v)
		}
		return r.execBody(n.body, inner)
	default:
		return fmt.Errorf("chattmpl: internal error: unknown node %T", n)
	}
	return nil
}

// capture renders body into a string instead of the output.
// captureFiltered renders body into a string and runs it through filters
// in order: the value of a {% set x | f %} block and of a {% filter f %}
// block.
func (r *renderer) captureFiltered(body []node, filters []*filterExpr, sc *scope) (any, error) {
	s, err := r.capture(body, sc)
	if err != nil {
		return nil, err
	}
	var v any = s
	for _, f := range filters {
		if v, err = r.applyFilter(f, v, sc); err != nil {
			return nil, err
		}
	}
	return v, nil
}

func (r *renderer) capture(body []node, sc *scope) (string, error) {
	saved := r.out
	var b strings.Builder
	r.out = &b
	genOn := r.genOn
	r.genOn = nil // generation spans inside captured text cannot be located in the output
	err := r.execBody(body, sc)
	r.out, r.genOn = saved, genOn
	return b.String(), err
}

func (r *renderer) assign(targets []string, unpack bool, v any, sc *scope, line int) error {
	if !unpack {
		sc.set(targets[0], v)
		return nil
	}
	items, err := iterate(v)
	if err != nil {
		return r.rtErr(line, fmt.Errorf("cannot unpack non-iterable %s object", typeName(v)))
	}
	if len(items) != len(targets) {
		return &Error{Kind: ErrRender, Line: line, Msg: fmt.Sprintf("cannot unpack %d values into %d names (%s)", len(items), len(targets), strings.Join(targets, ", "))}
	}
	for i, t := range targets {
		sc.set(t, items[i])
	}
	return nil
}

func (r *renderer) execFor(n *forNode, sc *scope) error {
	it, err := r.eval(n.iter, sc)
	if err != nil {
		return err
	}
	items, err := iterate(it)
	if err != nil {
		return r.rtErr(n.line, err)
	}
	if n.cond != nil {
		var kept []any
		for _, item := range items {
			tmp := &scope{parent: sc}
			if err := r.assign(n.targets, n.unpack, item, tmp, n.line); err != nil {
				return err
			}
			c, err := r.eval(n.cond, tmp)
			if err != nil {
				return err
			}
			if truthy(c) {
				kept = append(kept, item)
			}
		}
		items = kept
	}
	if len(items) == 0 {
		return r.execBody(n.els, sc)
	}
	loop := &loopObj{items: items}
	for i, item := range items {
		loop.index0 = i
		iter := &scope{parent: sc, vars: make([]binding, 1, 4)}
		iter.vars[0] = binding{"loop", loop}
		if err := r.assign(n.targets, n.unpack, item, iter, n.line); err != nil {
			return err
		}
		err := r.execBody(n.body, iter)
		if ctl, ok := err.(errLoopCtl); ok {
			if ctl.brk {
				break
			}
			continue
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// loopObj is jinja2's LoopContext.
type loopObj struct {
	items    []any
	index0   int
	lastSeen *any // for loop.changed()
}

func (l *loopObj) attr(name string) (any, bool) {
	n := len(l.items)
	switch name {
	case "index0":
		return int64(l.index0), true
	case "index":
		return int64(l.index0 + 1), true
	case "revindex":
		return int64(n - l.index0), true
	case "revindex0":
		return int64(n - l.index0 - 1), true
	case "first":
		return l.index0 == 0, true
	case "last":
		return l.index0 == n-1, true
	case "length":
		return int64(n), true
	case "depth":
		return int64(1), true
	case "depth0":
		return int64(0), true
	case "previtem":
		if l.index0 == 0 {
			return Undefined{hint: "there is no previous item"}, true
		}
		return l.items[l.index0-1], true
	case "nextitem":
		if l.index0 == n-1 {
			return Undefined{hint: "there is no next item"}, true
		}
		return l.items[l.index0+1], true
	case "cycle":
		return builtinFunc(func(_ *renderer, args []any, _ []kwval) (any, error) {
			if len(args) == 0 {
				return nil, fmt.Errorf("loop.cycle() needs at least one argument")
			}
			return args[l.index0%len(args)], nil
		}), true
	case "changed":
		return builtinFunc(func(_ *renderer, args []any, _ []kwval) (any, error) {
			v := any(Tuple(args))
			if l.lastSeen != nil && pyEqual(*l.lastSeen, v) {
				return false, nil
			}
			l.lastSeen = &v
			return true, nil
		}), true
	}
	return nil, false
}

// macro is a {% macro %} bound to the scope it was defined in; names inside
// resolve against that scope at call time, as in jinja2.
type macro struct {
	node     *macroNode
	defScope *scope
	name     string
}

// kwval is one evaluated keyword argument.
type kwval struct {
	name string
	v    any
}

// builtinFunc is a callable global, method or loop helper.
type builtinFunc func(r *renderer, args []any, kwargs []kwval) (any, error)

func (r *renderer) call(fn any, args []any, kwargs []kwval, line int) (any, error) {
	switch f := fn.(type) {
	case builtinFunc:
		v, err := f(r, args, kwargs)
		if err != nil {
			return nil, r.rtErr(line, err)
		}
		return v, nil
	case *macro:
		return r.callMacro(f, args, kwargs, line)
	case Undefined:
		return nil, r.rtErr(line, undefErr(f))
	}
	return nil, r.rtErr(line, fmt.Errorf("'%s' object is not callable", typeName(fn)))
}

func (r *renderer) callMacro(m *macro, args []any, kwargs []kwval, line int) (any, error) {
	n := m.node
	sc := &scope{parent: m.defScope}
	var extra []any
	for i, a := range args {
		if i < len(n.params) {
			sc.set(n.params[i], a)
		} else {
			extra = append(extra, a)
		}
	}
	kw := NewDict()
	for _, k := range kwargs {
		found := false
		for _, p := range n.params {
			if p == k.name {
				if sc.local(p) {
					return nil, &Error{Kind: ErrRender, Line: line, Msg: fmt.Sprintf("macro '%s' got multiple values for argument '%s'", n.name, p)}
				}
				sc.set(p, k.v)
				found = true
			}
		}
		if !found {
			kw.Set(k.name, k.v)
		}
	}
	for i, p := range n.params {
		if sc.local(p) {
			continue
		}
		if n.defaults[i] != nil {
			v, err := r.eval(n.defaults[i], sc)
			if err != nil {
				return nil, err
			}
			sc.set(p, v)
		} else {
			sc.set(p, Undefined{hint: fmt.Sprintf("parameter '%s' was not provided", p)})
		}
	}
	sc.set("varargs", Tuple(extra))
	sc.set("kwargs", kw)
	s, err := r.capture(n.body, sc)
	if err != nil {
		if _, ok := err.(errLoopCtl); ok {
			return nil, &Error{Kind: ErrRender, Line: n.line, Msg: "break/continue outside of a loop in macro " + n.name}
		}
		return nil, err
	}
	return s, nil
}

// ---- expressions ----

func (r *renderer) eval(x expr, sc *scope) (any, error) {
	switch x := x.(type) {
	case *constExpr:
		return x.v, nil
	case *nameExpr:
		if v, ok := sc.lookup(x.name); ok {
			return v, nil
		}
		if v, ok := r.env.globals[x.name]; ok {
			return v, nil
		}
		return Undefined{hint: fmt.Sprintf("'%s' is undefined", x.name)}, nil
	case *getattrExpr:
		obj, err := r.eval(x.obj, sc)
		if err != nil {
			return nil, err
		}
		v, err := getAttr(obj, x.attr)
		if err != nil {
			return nil, r.rtErr(x.line, err)
		}
		return v, nil
	case *getitemExpr:
		obj, err := r.eval(x.obj, sc)
		if err != nil {
			return nil, err
		}
		key, err := r.eval(x.key, sc)
		if err != nil {
			return nil, err
		}
		v, err := getItem(obj, key)
		if err != nil {
			return nil, r.rtErr(x.line, err)
		}
		return v, nil
	case *sliceExpr:
		obj, err := r.eval(x.obj, sc)
		if err != nil {
			return nil, err
		}
		var parts [3]any
		for i, e := range []expr{x.start, x.stop, x.step} {
			if e != nil {
				if parts[i], err = r.eval(e, sc); err != nil {
					return nil, err
				}
			}
		}
		v, err := sliceValue(obj, parts[0], parts[1], parts[2])
		if err != nil {
			return nil, r.rtErr(x.line, err)
		}
		return v, nil
	case *callExpr:
		fn, err := r.eval(x.fn, sc)
		if err != nil {
			return nil, err
		}
		args, kws, err := r.evalArgs(x.args, x.kwargs, sc)
		if err != nil {
			return nil, err
		}
		return r.call(fn, args, kws, x.line)
	case *filterExpr:
		obj, err := r.eval(x.obj, sc)
		if err != nil {
			return nil, err
		}
		return r.applyFilter(x, obj, sc)
	case *testExpr:
		obj, err := r.eval(x.obj, sc)
		if err != nil {
			return nil, err
		}
		args, kws, err := r.evalArgs(x.args, x.kwargs, sc)
		if err != nil {
			return nil, err
		}
		ok, err := x.fn(r, obj, args, kws)
		if err != nil {
			return nil, r.rtErr(x.line, fmt.Errorf("test '%s': %w", x.name, err))
		}
		return ok, nil
	case *binExpr:
		return r.evalBin(x, sc)
	case *unaryExpr:
		v, err := r.eval(x.x, sc)
		if err != nil {
			return nil, err
		}
		switch x.op {
		case "not":
			return !truthy(v), nil
		case "-":
			switch n := v.(type) {
			case bool, int64:
				i, _ := asInt(n)
				if i == math.MinInt64 {
					return nil, r.rtErr(x.line, fmt.Errorf("integer overflow in -%d", i))
				}
				return -i, nil
			case float64:
				return -n, nil
			}
		case "+":
			switch n := v.(type) {
			case bool, int64:
				i, _ := asInt(n)
				return i, nil
			case float64:
				return n, nil
			}
		}
		if u, ok := v.(Undefined); ok {
			return nil, r.rtErr(x.line, undefErr(u))
		}
		return nil, r.rtErr(x.line, fmt.Errorf("bad operand type for unary %s: '%s'", x.op, typeName(v)))
	case *compareExpr:
		left, err := r.eval(x.first, sc)
		if err != nil {
			return nil, err
		}
		for i, op := range x.ops {
			right, err := r.eval(x.rest[i], sc)
			if err != nil {
				return nil, err
			}
			ok, err := compareOp(op, left, right)
			if err != nil {
				return nil, r.rtErr(x.line, err)
			}
			if !ok {
				return false, nil
			}
			left = right
		}
		return true, nil
	case *condExpr:
		c, err := r.eval(x.cond, sc)
		if err != nil {
			return nil, err
		}
		if truthy(c) {
			return r.eval(x.a, sc)
		}
		if x.b == nil {
			return Undefined{hint: "the inline if-expression has no else clause"}, nil
		}
		return r.eval(x.b, sc)
	case *listExpr:
		out := make([]any, len(x.items))
		for i, e := range x.items {
			v, err := r.eval(e, sc)
			if err != nil {
				return nil, err
			}
			out[i] = v
		}
		return out, nil
	case *tupleExpr:
		out := make(Tuple, len(x.items))
		for i, e := range x.items {
			v, err := r.eval(e, sc)
			if err != nil {
				return nil, err
			}
			out[i] = v
		}
		return out, nil
	case *dictExpr:
		d := NewDict()
		for i := range x.keys {
			k, err := r.eval(x.keys[i], sc)
			if err != nil {
				return nil, err
			}
			if !hashable(k) {
				return nil, r.rtErr(x.line, fmt.Errorf("unhashable type: '%s'", typeName(k)))
			}
			v, err := r.eval(x.vals[i], sc)
			if err != nil {
				return nil, err
			}
			d.Set(k, v)
		}
		return d, nil
	}
	return nil, fmt.Errorf("chattmpl: internal error: unknown expression %T", x)
}

func (r *renderer) evalArgs(xs []expr, kws []kwarg, sc *scope) ([]any, []kwval, error) {
	args := make([]any, len(xs))
	for i, e := range xs {
		v, err := r.eval(e, sc)
		if err != nil {
			return nil, nil, err
		}
		args[i] = v
	}
	var out []kwval
	for _, k := range kws {
		v, err := r.eval(k.x, sc)
		if err != nil {
			return nil, nil, err
		}
		out = append(out, kwval{k.name, v})
	}
	return args, out, nil
}

func (r *renderer) applyFilter(f *filterExpr, v any, sc *scope) (any, error) {
	args, kws, err := r.evalArgs(f.args, f.kwargs, sc)
	if err != nil {
		return nil, err
	}
	out, err := f.fn(r, v, args, kws)
	if err != nil {
		var e *Error
		if errors.As(err, &e) {
			return nil, err
		}
		return nil, r.rtErr(f.line, fmt.Errorf("filter '%s': %w", f.name, err))
	}
	return out, nil
}

func (r *renderer) evalBin(x *binExpr, sc *scope) (any, error) {
	l, err := r.eval(x.l, sc)
	if err != nil {
		return nil, err
	}
	switch x.op {
	case "and":
		if !truthy(l) {
			return l, nil
		}
		return r.eval(x.r, sc)
	case "or":
		if truthy(l) {
			return l, nil
		}
		return r.eval(x.r, sc)
	}
	rv, err := r.eval(x.r, sc)
	if err != nil {
		return nil, err
	}
	v, err := binaryOp(x.op, l, rv)
	if err != nil {
		return nil, r.rtErr(x.line, err)
	}
	return v, nil
}

func undefErr(u Undefined) error {
	if u.hint == "" {
		return fmt.Errorf("value is undefined")
	}
	return fmt.Errorf("%s", u.hint)
}

func binaryOp(op string, a, b any) (any, error) {
	if u, ok := a.(Undefined); ok && op != "~" {
		return nil, undefErr(u)
	}
	if u, ok := b.(Undefined); ok && op != "~" {
		return nil, undefErr(u)
	}
	if op == "~" {
		return toStr(a) + toStr(b), nil
	}
	for _, x := range []any{a, b} {
		if n, ok := x.(*big.Int); ok {
			return nil, fmt.Errorf("integer %s does not fit in 64 bits; chattmpl cannot compute with it", n)
		}
	}
	if isNumber(a) && isNumber(b) {
		return numOp(op, a, b)
	}
	switch op {
	case "+":
		switch x := a.(type) {
		case string:
			if y, ok := b.(string); ok {
				return x + y, nil
			}
			return nil, fmt.Errorf("can only concatenate str (not \"%s\") to str", typeName(b))
		case []any:
			if y, ok := b.([]any); ok {
				out := make([]any, 0, len(x)+len(y))
				return append(append(out, x...), y...), nil
			}
			return nil, fmt.Errorf("can only concatenate list (not \"%s\") to list", typeName(b))
		case Tuple:
			if y, ok := b.(Tuple); ok {
				out := make(Tuple, 0, len(x)+len(y))
				return append(append(out, x...), y...), nil
			}
		}
	case "*":
		if n, ok := asInt(b); ok {
			return repeatSeq(a, n)
		}
		if n, ok := asInt(a); ok {
			return repeatSeq(b, n)
		}
	case "%":
		if s, ok := a.(string); ok {
			return percentFormat(s, b)
		}
	}
	return nil, fmt.Errorf("unsupported operand type(s) for %s: '%s' and '%s'", op, typeName(a), typeName(b))
}

func repeatSeq(v any, n int64) (any, error) {
	if n < 0 {
		n = 0
	}
	switch x := v.(type) {
	case string:
		if int64(len(x))*n > 1<<26 {
			return nil, fmt.Errorf("string repetition result too large")
		}
		return strings.Repeat(x, int(n)), nil
	case []any:
		if int64(len(x))*n > 1<<22 {
			return nil, fmt.Errorf("list repetition result too large")
		}
		out := []any{}
		for i := int64(0); i < n; i++ {
			out = append(out, x...)
		}
		return out, nil
	}
	return nil, fmt.Errorf("can't multiply sequence of type '%s' by int", typeName(v))
}

func numOp(op string, a, b any) (any, error) {
	ai, aInt := asInt(a)
	bi, bInt := asInt(b)
	if aInt && bInt {
		switch op {
		case "+":
			s := ai + bi
			if (s > ai) != (bi > 0) {
				return nil, fmt.Errorf("integer overflow in %d + %d", ai, bi)
			}
			return s, nil
		case "-":
			s := ai - bi
			if (s < ai) != (bi > 0) {
				return nil, fmt.Errorf("integer overflow in %d - %d", ai, bi)
			}
			return s, nil
		case "*":
			if ai != 0 && bi != 0 {
				p := ai * bi
				if p/bi != ai || (ai == -1 && bi == math.MinInt64) || (bi == -1 && ai == math.MinInt64) {
					return nil, fmt.Errorf("integer overflow in %d * %d", ai, bi)
				}
				return p, nil
			}
			return int64(0), nil
		case "/":
			if bi == 0 {
				return nil, fmt.Errorf("division by zero")
			}
			return float64(ai) / float64(bi), nil
		case "//":
			if bi == 0 {
				return nil, fmt.Errorf("integer division or modulo by zero")
			}
			q := ai / bi
			if (ai%bi != 0) && ((ai < 0) != (bi < 0)) {
				q--
			}
			return q, nil
		case "%":
			if bi == 0 {
				return nil, fmt.Errorf("integer division or modulo by zero")
			}
			m := ai % bi
			if m != 0 && ((m < 0) != (bi < 0)) {
				m += bi
			}
			return m, nil
		case "**":
			if bi < 0 {
				return math.Pow(float64(ai), float64(bi)), nil
			}
			res := int64(1)
			for i := int64(0); i < bi; i++ {
				n := res * ai
				if ai != 0 && n/ai != res {
					return nil, fmt.Errorf("integer overflow in %d ** %d", ai, bi)
				}
				res = n
			}
			return res, nil
		}
	}
	fa, fb := asFloat(a), asFloat(b)
	switch op {
	case "+":
		return fa + fb, nil
	case "-":
		return fa - fb, nil
	case "*":
		return fa * fb, nil
	case "/":
		if fb == 0 {
			return nil, fmt.Errorf("float division by zero")
		}
		return fa / fb, nil
	case "//":
		if fb == 0 {
			return nil, fmt.Errorf("float floor division by zero")
		}
		return math.Floor(fa / fb), nil
	case "%":
		if fb == 0 {
			return nil, fmt.Errorf("float modulo")
		}
		m := math.Mod(fa, fb)
		if m != 0 && ((m < 0) != (fb < 0)) {
			m += fb
		}
		return m, nil
	case "**":
		return math.Pow(fa, fb), nil
	}
	return nil, fmt.Errorf("unknown operator %s", op)
}

func compareOp(op string, a, b any) (bool, error) {
	switch op {
	case "==":
		return pyEqual(a, b), nil
	case "!=":
		return !pyEqual(a, b), nil
	case "in":
		return contains(b, a)
	case "notin":
		ok, err := contains(b, a)
		return !ok, err
	}
	c, err := pyCompare(a, b, op)
	if err != nil {
		return false, err
	}
	switch op {
	case "<":
		return c < 0, nil
	case "<=":
		return c <= 0, nil
	case ">":
		return c > 0, nil
	case ">=":
		return c >= 0, nil
	}
	return false, fmt.Errorf("unknown comparison %s", op)
}

// contains is Python's "needle in haystack".
func contains(hay, needle any) (bool, error) {
	switch h := hay.(type) {
	case string:
		s, ok := needle.(string)
		if !ok {
			return false, fmt.Errorf("'in <string>' requires string as left operand, not %s", typeName(needle))
		}
		return strings.Contains(h, s), nil
	case []any:
		for _, e := range h {
			if pyEqual(e, needle) {
				return true, nil
			}
		}
		return false, nil
	case Tuple:
		for _, e := range h {
			if pyEqual(e, needle) {
				return true, nil
			}
		}
		return false, nil
	case *Dict:
		_, ok := h.Get(needle)
		return ok, nil
	case Undefined:
		return false, nil
	}
	return false, fmt.Errorf("argument of type '%s' is not iterable", typeName(hay))
}

// getAttr is jinja2's sandboxed getattr: Python attribute first (methods of
// str/list/dict), then item lookup; a miss is Undefined.
func getAttr(obj any, name string) (any, error) {
	switch o := obj.(type) {
	case Undefined:
		return nil, undefErr(o)
	case *Namespace:
		if v, ok := o.attrs.Get(name); ok {
			return v, nil
		}
	case *loopObj:
		if v, ok := o.attr(name); ok {
			return v, nil
		}
	case *Dict:
		if m, ok := method(obj, name); ok {
			return m, nil
		}
		if v, ok := o.Get(name); ok {
			return v, nil
		}
		return Undefined{hint: fmt.Sprintf("'dict object' has no attribute '%s'", name)}, nil
	default:
		if m, ok := method(obj, name); ok {
			return m, nil
		}
	}
	return Undefined{hint: fmt.Sprintf("'%s' object has no attribute '%s'", typeName(obj), name)}, nil
}

// getItem is jinja2's sandboxed getitem: item lookup first, then attribute
// for string keys.
func getItem(obj any, key any) (any, error) {
	switch o := obj.(type) {
	case Undefined:
		return nil, undefErr(o)
	case *Dict:
		if !hashable(key) {
			return nil, fmt.Errorf("unhashable type: '%s'", typeName(key))
		}
		if v, ok := o.Get(key); ok {
			return v, nil
		}
	case []any, Tuple, string:
		if i, ok := asInt(key); ok {
			var n int
			switch s := o.(type) {
			case []any:
				n = len(s)
			case Tuple:
				n = len(s)
			case string:
				n = -1
			}
			if s, ok := o.(string); ok {
				rs := []rune(s)
				n = len(rs)
				j := int(i)
				if j < 0 {
					j += n
				}
				if j < 0 || j >= n {
					return Undefined{hint: fmt.Sprintf("string index %d out of range (length %d)", i, n)}, nil
				}
				return string(rs[j]), nil
			}
			j := int(i)
			if j < 0 {
				j += n
			}
			if j < 0 || j >= n {
				return Undefined{hint: fmt.Sprintf("%s index %d out of range (length %d)", typeName(obj), i, n)}, nil
			}
			if l, ok := o.([]any); ok {
				return l[j], nil
			}
			return o.(Tuple)[j], nil
		}
	}
	if s, ok := key.(string); ok {
		return getAttr(obj, s)
	}
	return Undefined{hint: fmt.Sprintf("'%s' object has no element %s", typeName(obj), repr(key))}, nil
}
