import { describe, it, beforeEach, afterAll } from 'vitest'
import { storageConformance } from '../lib/storage/conformance.js'
import { MemoryStorage } from '../lib/storage/memory.js'

storageConformance('memory', () => new MemoryStorage(), { describe, it, beforeEach, afterAll })
